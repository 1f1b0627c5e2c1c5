"""Synthetic routing traces (numpy only), in the format moejax.placement.trace records.

`counts[steps, layers, sources, experts]` = (token, k) choices each source device sent to
each expert. Per layer, expert popularity moves in log space as a slow, persistent part plus
per-step noise (real loads correlate ~0.8 step to step yet stay similar over hundreds of steps):
  z_t = sqrt(w) * s_t + sqrt(1 - w) * n_t,   s_t = slow * s_{t-1} + sqrt(1 - slow^2) * eps_t,
with n_t, eps_t ~ N(0, 1) per expert and w chosen so that consecutive steps' expert-load
vectors correlate about `corr` (z's lag-k correlation is w * slow^k):
  lognormal  p ∝ exp(sigma * z_t); for a lognormal vector the correlation of consecutive
             steps is (exp(sigma^2 rho) - 1) / (exp(sigma^2) - 1), solved for rho.
  zipf       a fixed random permutation of ranks per layer, p ∝ rank^-zipf_a, times the drift
             exp(sigma/2 * z_t) (the fixed ranks make loads correlate more than `corr`).
  collapse   a collapsed gate: one expert per layer is pinned at 40% of the
             assignments; a few (E/5) share ~55% and the rest 5% (well under 1% each), and
             these drift as exp(0.3 * z_t) within the other 60%.
  early_collapse  a router that collapses in the first steps of training: step t draws from
             (1 - a_t) * near-uniform + a_t * collapse, a_t = min(1, t / collapse_steps), the
             near-uniform part drifting as exp(0.1 * z_t) (a fresh router's spread), so a
             plan made from step 0 knows nothing of the collapse the next steps bring.
Every source draws its top_k * tokens_per_source choices from its own mildly perturbed p
(a fixed log-normal factor exp(source_sigma * g[layer, source, expert])), multinomially.
Simplification: a token's k choices are drawn independently, so one token may pick the same
expert twice; per-expert and per-source totals are what planners and replay use.

  python -m moejax.workloads --out benchmarks/traces/synthetic_skewed.npz --kind lognormal
"""

from __future__ import annotations

import zipfile

import numpy as np

from moejax.config import ConfigError
from moejax.placement.drift import check_trace_shape

KINDS = ("lognormal", "zipf", "collapse", "early_collapse")


def _rho_for(corr: float, scale: float) -> float:
  """AR(1) coefficient of z giving correlation `corr` between exp(scale * z) vectors."""
  corr = float(np.clip(corr, 0.0, 0.999))
  s2 = max(scale * scale, 1e-9)
  return float(np.clip(np.log1p(corr * np.expm1(s2)) / s2, 0.0, 0.9999))


def _ar1(rng, steps: int, shape: tuple[int, ...], rho: float) -> np.ndarray:
  z = np.empty((steps, *shape))
  z[0] = rng.standard_normal(shape)
  eps = rng.standard_normal((steps, *shape))
  for t in range(1, steps):
    z[t] = rho * z[t - 1] + np.sqrt(1.0 - rho * rho) * eps[t]
  return z


def _collapse_base(rng, layers: int, experts: int) -> tuple[np.ndarray, np.ndarray]:
  """(log p0 [L, E], top expert [L]): top 40%, E/5 'mid' experts ~55%, the rest 5%."""
  out, top = np.empty((layers, experts)), np.empty(layers, np.int64)
  mid = min(max(1, round(experts * 0.2)), experts - 1)
  tail = experts - 1 - mid
  for layer in range(layers):
    w = np.empty(experts)
    w[0] = 0.40
    m = np.exp(0.5 * rng.standard_normal(mid))
    w[1:1 + mid] = (0.55 if tail else 0.60) * m / m.sum()
    w[1 + mid:] = 0.05 / max(tail, 1)
    perm = rng.permutation(experts)
    out[layer], top[layer] = np.log(w[perm]), np.flatnonzero(perm == 0)[0]
  return out, top


def synthetic_trace(steps: int, layers: int, sources: int, experts: int, top_k: int = 2,
                    tokens_per_source: int = 2048, kind: str = "lognormal", sigma: float = 1.0,
                    zipf_a: float = 1.1, corr: float = 0.8, seed: int = 0,
                    source_sigma: float = 0.2, slow: float = 0.999,
                    collapse_steps: int = 3) -> dict:
  """Returns dict(counts=int64 [steps, layers, sources, experts], top_k=, step=arange(steps)).
  `collapse_steps`: early_collapse's steps from near-uniform to fully collapsed."""
  check_trace_shape("synthetic_trace", steps, layers, sources, experts, top_k, tokens_per_source)
  if kind not in KINDS:
    raise ConfigError(f"synthetic_trace kind={kind!r} is unknown; choose one of {list(KINDS)}.")
  if int(collapse_steps) < 1:
    raise ConfigError(f"synthetic_trace collapse_steps={collapse_steps} must be >= 1 (1: "
                      "collapsed from step 1 on).")
  rng = np.random.default_rng(seed)
  if kind == "lognormal":
    base, scale = np.zeros((layers, experts)), sigma
  elif kind == "zipf":
    ranks = np.stack([rng.permutation(experts) + 1 for _ in range(layers)])
    base, scale = -zipf_a * np.log(ranks), sigma / 2
  else:
    (base, top), scale = _collapse_base(rng, layers, experts), 0.3
  collapsing = kind in ("collapse", "early_collapse")
  w = min(1.0, _rho_for(corr, scale) / slow)
  z = (np.sqrt(w) * _ar1(rng, steps, (layers, experts), slow) +
       np.sqrt(1.0 - w) * rng.standard_normal((steps, layers, experts)))
  logp = base[None] + scale * z                                        # [steps, L, E]
  p = np.exp(logp - logp.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  if collapsing and experts > 1:                                       # pin the top at 40%
    is_top = np.arange(experts)[None, :] == top[:, None]               # [L, E]
    p = np.where(is_top, 0.0, p)
    p = np.where(is_top, 0.40, 0.60 * p / p.sum(-1, keepdims=True))
  if kind == "early_collapse":       # a fresh router's near-uniform spread, fading out
    fresh = np.exp(0.1 * z)
    fresh /= fresh.sum(-1, keepdims=True)
    a_t = np.minimum(1.0, np.arange(steps) / collapse_steps)[:, None, None]
    p = (1.0 - a_t) * fresh + a_t * p
  src = np.exp(source_sigma * rng.standard_normal((layers, sources, experts)))
  p = p[:, :, None, :] * src[None]                                     # [steps, L, W, E]
  p /= p.sum(-1, keepdims=True)
  counts = rng.multinomial(top_k * tokens_per_source, p).astype(np.int64)
  return {"counts": counts, "top_k": int(top_k), "step": np.arange(steps, dtype=np.int64)}


def save_trace(path, trace: dict) -> None:
  arrays = {"counts": np.asarray(trace["counts"])}
  for key in ("top_k", "step"):
    if trace.get(key) is not None:
      arrays[key] = np.asarray(trace[key])
  np.savez_compressed(path, **arrays)


def load_trace(path) -> dict:
  """Loads and validates a routing trace .npz; one-line ConfigError if it is not one."""
  try:
    with np.load(path, allow_pickle=False) as f:
      data = {k: f[k] for k in f.files}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    raise ConfigError(f"trace {path}: cannot read it as an .npz ({type(e).__name__}).") from None
  if not isinstance(data, dict) or "counts" not in data:
    raise ConfigError(f"trace {path} has no 'counts' array; expected counts[steps, layers, "
                      "sources, experts].")
  counts = data["counts"]
  if counts.ndim != 4 or not np.issubdtype(counts.dtype, np.integer):
    raise ConfigError(f"trace {path}: counts must be a 4-D integer array [steps, layers, "
                      f"sources, experts], got {counts.dtype} {counts.shape}.")
  if counts.size and counts.min() < 0:
    raise ConfigError(f"trace {path}: counts must be non-negative.")
  out = {"counts": counts.astype(np.int64)}
  if "top_k" in data:
    if data["top_k"].size != 1 or not np.issubdtype(data["top_k"].dtype, np.integer):
      raise ConfigError(f"trace {path}: top_k must be one integer, got {data['top_k']!r}.")
    out["top_k"] = int(data["top_k"])
  if "step" in data:
    step = data["step"]
    if step.ndim != 1 or len(step) != counts.shape[0]:
      raise ConfigError(f"trace {path}: step has shape {step.shape} but counts has "
                        f"{counts.shape[0]} steps.")
    out["step"] = step
  else:
    out["step"] = np.arange(counts.shape[0], dtype=np.int64)
  return out
