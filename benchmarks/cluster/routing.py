"""Routing for the cluster study: a committed trace scaled to a model's expert count and to
the sources of one data row of a mesh, and the force-balanced (uniform) routing.

How a trace is scaled (`scaled_counts`), in order:
  1. Sources are pooled until each pool holds at least `MIN_POOL_CHOICES` choices a step (a
     trace recorded at a few hundred choices a source carries that much multinomial noise,
     which re-sampling at a GPU's count would turn into skew). Target source w reads pool
     w % pools.
  2. Experts: the ids are shuffled once (seed 0), since which experts share a device is
     arbitrary; then a target with m times the trace's experts splits each trace expert into
     m of equal share (an expert's share over the mean is kept exactly, and so is its drift
     over steps), and one with m times fewer merges groups of m (a coarse expert is its fine
     experts together, as a fine-grained model splits a coarse one).
  3. No expert may take more than 1/k of a source's choices (each token picks k distinct
     experts): shares above are capped and the rest spread over the others.
  4. Each source's counts are a multinomial draw of the target's choices a source (tokens per
     GPU x k) from those shares, one per step and layer (seeded).
The trace's layers stand for the model's: a layer of the model is costed as the mean of the
trace's layers.
"""

from __future__ import annotations

import numpy as np

from moejax.placement.synthetic import load_trace

MIN_POOL_CHOICES = 4096
TRACES = {
    "drift_bursts": "benchmarks/traces/drift_bursts.npz",
    "synthetic_skewed": "benchmarks/traces/synthetic_skewed.npz",
    "default_run": "benchmarks/traces/default_run.npz",
}
UNIFORM = "uniform"
ROUTINGS = (UNIFORM, *TRACES)


def pooled_shares(counts_SxLxWxE: np.ndarray) -> np.ndarray:
  """[S, L, pools, E]: each pool's share of its choices per expert (step 1 of the module)."""
  counts = np.asarray(counts_SxLxWxE, np.float64)
  sources = counts.shape[2]
  per_source = float(counts[:, :, 0].sum(-1).min())
  size = 1
  while size < sources and (per_source * size < MIN_POOL_CHOICES or sources % size):
    size += 1
  pooled = counts.reshape(*counts.shape[:2], sources // size, size, -1).sum(3)
  return pooled / np.maximum(pooled.sum(-1, keepdims=True), 1)


def map_experts(shares_E: np.ndarray, experts: int, seed: int = 0) -> np.ndarray:
  """Shares over the trace's experts (last axis) -> over `experts` (step 2 of the module)."""
  have = shares_E.shape[-1]
  order = np.random.default_rng(seed).permutation(max(have, experts))
  if experts >= have:
    if experts % have:
      raise ValueError(f"experts={experts} is not a multiple of the trace's {have}")
    split = np.repeat(shares_E, experts // have, axis=-1) / (experts // have)
    return split[..., order]
  if have % experts:
    raise ValueError(f"the trace's {have} experts are not a multiple of experts={experts}")
  shuffled = shares_E[..., order]
  return shuffled.reshape(*shares_E.shape[:-1], experts, have // experts).sum(-1)


def cap_shares(shares: np.ndarray, top_k: int) -> np.ndarray:
  """Shares with none above 1/top_k, the excess spread over the others by their shares (step
  3); each row still sums to one."""
  p = np.array(shares, np.float64)
  limit = 1.0 / top_k
  for _ in range(p.shape[-1]):
    over = p > limit + 1e-12
    if not over.any():
      break
    excess = np.where(over, p - limit, 0).sum(-1, keepdims=True)
    p = np.where(over, limit, p)
    free = np.where(over | (p >= limit), 0, p)
    p = p + excess * free / np.maximum(free.sum(-1, keepdims=True), 1e-300)
  return p


def scaled_counts(name: str, experts: int, sources: int, choices_per_source: int,
                  top_k: int, steps: int | None = None, seed: int = 0) -> np.ndarray:
  """[S, L, sources, experts] int64 counts of trace `name` (TRACES) scaled as the module
  says; `steps`: the first that many of the trace's steps."""
  counts = load_trace(TRACES[name])["counts"]
  if steps is not None:
    counts = counts[:steps]
  shares = cap_shares(map_experts(pooled_shares(counts), experts, seed), top_k)
  pools = shares.shape[2]
  per_source = shares[:, :, np.arange(sources) % pools]            # [S, L, sources, E]
  rng = np.random.default_rng(seed + 1)
  return rng.multinomial(choices_per_source, per_source).astype(np.int64)


def uniform_counts(experts: int, sources: int, choices_per_source: int, layers: int = 2,
                   steps: int = 20) -> np.ndarray:
  """Force-balanced routing: every source sends every expert exactly its even share."""
  if choices_per_source % experts:
    raise ValueError(f"{choices_per_source} choices a source do not split evenly over "
                     f"{experts} experts")
  return np.full((steps, layers, sources, experts), choices_per_source // experts, np.int64)


def routing(name: str, experts: int, sources: int, choices_per_source: int, top_k: int,
            steps: int | None = None) -> np.ndarray:
  if name == UNIFORM:
    return uniform_counts(experts, sources, choices_per_source)
  return scaled_counts(name, experts, sources, choices_per_source, top_k, steps)


def skew(counts_SxLxWxE: np.ndarray) -> dict:
  """The routing's expert max/mean (all sources), median and p90 over steps x layers."""
  totals = np.asarray(counts_SxLxWxE, np.float64).sum(2)
  mm = totals.max(-1) / totals.mean(-1)
  return {"expert_max_over_mean_median": float(np.median(mm)),
          "expert_max_over_mean_p90": float(np.percentile(mm, 90))}
