"""A drifting, bursty routing trace and the statistics that describe a trace (numpy only).

`drift_bursts_trace` models what a public GPT-MoE routing trace shows, rather than the far
noisier `lognormal` kind: per layer, expert popularity is
  log p_t = sigma * base + drift_t + noise_t,   then bursts,
- `base` ~ N(0, 1) per expert, fixed: a persistent log-normal skew (sigma = 1);
- `drift_t`: per expert, white noise low-passed twice with time constant `drift_steps`,
  std `drift_std`: the ranking moves over hundreds of steps, barely from step to step;
- `noise_t`: independent per step, Student-t with `noise_df` degrees of freedom times
  `noise`, clipped to +-1 (heavy-tailed: most steps move a hot expert's share by a few
  percent, one in ten by 15% or more);
- bursts: per layer, a burst starts at each step with probability `burst_rate`, picks an
  expert uniformly and multiplies its share by `burst_factor` (the others shrink to keep the
  sum) for a duration drawn uniformly from `burst_steps`; bursts may overlap.
Every source draws top_k * tokens_per_source choices from p times its own fixed log-normal
factor (`source_sigma`), multinomially, as in `workloads.synthetic_trace`.

`step_change` measures what the issue asks of such a trace: the relative change of a hot
expert's share from one step to the next (hot: the layer's `hot` largest experts by mean
share), median and p90.
"""

from __future__ import annotations

import numpy as np

from moejax.config import ConfigError


def check_trace_shape(fn: str, steps: int, layers: int, sources: int, experts: int,
                      top_k: int, tokens_per_source: int) -> None:
  """A one-line ConfigError, naming `fn`, for a trace's shape arguments out of range."""
  for name, v in (("steps", steps), ("layers", layers), ("sources", sources),
                  ("experts", experts), ("tokens_per_source", tokens_per_source)):
    if int(v) < 1:
      raise ConfigError(f"{fn} {name}={v} must be >= 1.")
  if not 1 <= top_k <= experts:
    raise ConfigError(f"{fn} top_k={top_k} must be in [1, experts={experts}].")


def drift_bursts_trace(steps: int = 600, layers: int = 2, sources: int = 16, experts: int = 32,
                       top_k: int = 2, tokens_per_source: int = 2048, sigma: float = 1.0,
                       drift_std: float = 0.3, drift_steps: int = 100, noise: float = 0.014,
                       noise_df: float = 1.2,
                       burst_rate: float = 0.01, burst_factor: float = 3.0,
                       burst_steps: tuple[int, int] = (5, 20), source_sigma: float = 0.2,
                       seed: int = 0) -> dict:
  """Returns dict(counts=int64 [steps, layers, sources, experts], top_k=, step=, bursts=
  int64 [B, 4] rows (layer, expert, first step, steps))."""
  check_trace_shape("drift_bursts_trace", steps, layers, sources, experts, top_k,
                    tokens_per_source)
  lo, hi = burst_steps
  if not 1 <= lo <= hi or not 0 <= burst_rate <= 1 or burst_factor <= 0:
    raise ConfigError(f"drift_bursts_trace bursts: steps {burst_steps} must be 1 <= lo <= hi, "
                      f"rate {burst_rate} in [0, 1], factor {burst_factor} > 0.")
  rng = np.random.default_rng(seed)
  base = sigma * rng.standard_normal((layers, experts))
  drift = _smooth_drift(rng, steps, (layers, experts), drift_steps) * drift_std
  jolt = np.clip(noise * rng.standard_t(noise_df, (steps, layers, experts)), -1.0, 1.0)
  logp = base[None] + drift + jolt
  p = np.exp(logp - logp.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  factor = np.ones((steps, layers, experts))
  bursts = []
  for layer in range(layers):
    for t0 in np.flatnonzero(rng.random(steps) < burst_rate):
      e, dur = int(rng.integers(experts)), int(rng.integers(lo, hi + 1))
      factor[t0:t0 + dur, layer, e] *= burst_factor
      bursts.append((layer, e, int(t0), min(dur, steps - int(t0))))
  p = _scale_shares(p, factor)
  src = np.exp(source_sigma * rng.standard_normal((layers, sources, experts)))
  p = p[:, :, None, :] * src[None]                                     # [steps, L, W, E]
  p /= p.sum(-1, keepdims=True)
  counts = rng.multinomial(top_k * tokens_per_source, p).astype(np.int64)
  return {"counts": counts, "top_k": int(top_k), "step": np.arange(steps, dtype=np.int64),
          "bursts": np.asarray(bursts, np.int64).reshape(-1, 4)}


def _smooth_drift(rng, steps: int, shape: tuple[int, ...], tau: int) -> np.ndarray:
  """White noise low-passed twice by an exponential filter of time constant `tau` steps
  (after a burn-in of 4 tau), scaled to unit std: it wanders over hundreds of steps but moves
  very little from one step to the next."""
  a = 1.0 - 1.0 / max(tau, 1)
  x, y = np.zeros(shape), np.zeros(shape)
  out = np.empty((steps, *shape))
  burn = 4 * max(tau, 1)
  for t, eps in enumerate(rng.standard_normal((burn + steps, *shape))):
    x = a * x + eps
    y = a * y + (1.0 - a) * x
    if t >= burn:
      out[t - burn] = y
  return out / max(float(out.std(0).mean()), 1e-12)


def _scale_shares(p_stepsxLxE: np.ndarray, factor_stepsxLxE: np.ndarray) -> np.ndarray:
  """Shares with the bursting experts' shares multiplied by their factor and the others
  shrunk in proportion to keep the sum at 1 (a bursting share is capped at 0.9)."""
  boosted = np.where(factor_stepsxLxE != 1.0, np.minimum(p_stepsxLxE * factor_stepsxLxE, 0.9), 0.0)
  total = np.minimum(boosted.sum(-1, keepdims=True), 0.9)
  boosted *= np.where(boosted.sum(-1, keepdims=True) > 0,
                      total / np.maximum(boosted.sum(-1, keepdims=True), 1e-300), 1.0)
  rest = np.where(factor_stepsxLxE != 1.0, 0.0, p_stepsxLxE)
  rest *= (1.0 - total) / np.maximum(rest.sum(-1, keepdims=True), 1e-300)
  return boosted + rest


def step_change(counts_stepsxLxWxE: np.ndarray, hot: int = 8) -> dict:
  """Relative change |share_{t+1} - share_t| / share_t of each layer's `hot` largest experts
  (by mean share), pooled over steps and layers: median, p90; plus the consecutive-step
  correlation of the expert-load vectors, the hottest expert's mean share and the choices per
  step and layer."""
  load = np.asarray(counts_stepsxLxWxE, np.float64).sum(2)               # [steps, L, E]
  share = load / np.maximum(load.sum(-1, keepdims=True), 1.0)
  top = np.argsort(-share.mean(0), axis=-1)[:, :hot]                  # [L, hot]
  s = np.take_along_axis(share, top[None], axis=-1)                   # [steps, L, hot]
  rel = np.abs(np.diff(s, axis=0)) / np.maximum(s[:-1], 1e-12)
  corr = [np.corrcoef(load[t, i], load[t + 1, i])[0, 1]
          for t in range(len(load) - 1) for i in range(load.shape[1])]
  return {"hot_change_median": float(np.median(rel)),
          "hot_change_p90": float(np.percentile(rel, 90)),
          "consecutive_corr": float(np.mean(corr)),
          "top_share_mean": float(share.max(-1).mean()),
          "choices_per_step_layer": int(load.sum(-1).mean())}
