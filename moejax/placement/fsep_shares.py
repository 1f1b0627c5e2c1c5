"""Token shares of the fsep planner's placed candidates: levelling and rounding (numpy only).

Candidates are Y layouts grid[Y, N, rounds] (the expert of each replica, at most one per
(device, expert)); shares are [Y, N, rounds] and sum to 1 per expert and candidate. Both steps
work on a flat list of the replicas that can still change: at N = 4096, E = 256, C = 8 the
experts snapped to even power-of-two shares (fsep.snap_counts) hold ~86% of the replicas, so
the other 14% are all that levelling and rounding touch.
"""

from __future__ import annotations

import numpy as np

from moejax.layout.placement import SHARE_PARTS


def expert_index(grid: np.ndarray, num_experts: int) -> np.ndarray:
  """[Y * N * rounds]: each replica's expert, offset by E per candidate (one table of all Y)."""
  k = grid.shape[0]
  if k == 1:                                 # the common case: no offsets to add
    return grid.reshape(-1)
  return (grid + (np.arange(k) * num_experts)[:, None, None]).ravel()


def level(grid: np.ndarray, r_YxE: np.ndarray, load_E: np.ndarray, iters: int,
          frozen_YxE: np.ndarray | None = None, alpha: float = 1.5,
          tol: float = 1e-3, live_out: list | None = None) -> np.ndarray:
  """Token shares [Y, N, rounds] of the replicas in grid[Y, N, rounds]. They start even
  (1/r_e); the replicas of experts not frozen (see snap_counts) are levelled towards equal
  device loads by up to `iters` Sinkhorn steps: each share is scaled by (its device's target /
  its device's levelled load) ** alpha, the target being the mean load less the device's
  frozen replicas' load (ratio clipped to [1/16, 16]; alpha > 1 over-relaxes, converging in a
  few steps where plain Sinkhorn needs tens), then renormalised per expert. Each step starts
  from the candidate's best shares so far (lowest busiest device), and a candidate whose step
  did not improve falls back to alpha = 1; stops early once every candidate is within `tol`
  of the mean or none improves any more. `live_out`: a list that receives the flat indices of
  the replicas of experts not frozen, when there are frozen ones (what `quantise` rounds)."""
  r_YxE = np.atleast_2d(r_YxE)
  k, n, rounds = grid.shape
  num_experts = len(load_E)
  gflat = expert_index(grid, num_experts)
  share = (1.0 / r_YxE.ravel()).take(gflat)
  mean = load_E.sum() / n
  if mean <= 0 or iters < 1:
    return share.reshape(grid.shape)
  fixed = np.zeros(k * n)
  live = None
  if frozen_YxE is not None and frozen_YxE.any():
    frozen_E = np.atleast_2d(frozen_YxE).ravel()
    per_E = np.where(frozen_E, np.tile(load_E, k) / r_YxE.ravel(), 0.0)
    fixed = np.einsum("ir->i", per_E.take(gflat).reshape(k * n, rounds))  # stay 1/r_e
    live = np.flatnonzero((~frozen_E).take(gflat))
    if live_out is not None:
      live_out.append(live)
  if live is None:
    live = np.arange(len(gflat))
  g = gflat.take(live)
  d, w = live // rounds, np.tile(load_E, k).take(g)           # candidate-major device ids
  cand = d // n
  target = np.maximum(mean - fixed, mean * 1e-6)
  a = np.full(k, float(alpha))
  best = share[live]
  best_load = np.bincount(d, weights=best * w, minlength=k * n)
  best_peak = (best_load + fixed).reshape(k, n).max(1)
  for _ in range(iters):
    if np.all(best_peak <= mean * (1 + tol)):
      break
    ratio = np.clip(target / np.maximum(best_load, 1e-300), 1.0 / 16, 16.0)
    s = best * ratio.take(d) ** a.take(cand)
    s /= np.bincount(g, weights=s, minlength=k * num_experts).take(g)
    dev_load = np.bincount(d, weights=s * w, minlength=k * n)
    peak = (dev_load + fixed).reshape(k, n).max(1)
    better = peak < best_peak - mean * 1e-4
    if not better.any() and np.all(a == 1.0):
      break
    take = better.take(cand)
    best = np.where(take, s, best)
    best_load = np.where(np.repeat(better, n), dev_load, best_load)
    best_peak = np.where(better, peak, best_peak)
    a[~better] = 1.0                     # overshot: retry from the best with plain Sinkhorn
  share[live] = best
  return share.reshape(grid.shape)


def quantise(grid: np.ndarray, share: np.ndarray, load_E: np.ndarray,
             groups: int = 8, base_YxN: np.ndarray | None = None,
             whole_YxE: np.ndarray | None = None, live: np.ndarray | None = None
             ) -> np.ndarray:
  """Shares [Y, N, rounds] rounded to whole parts of SHARE_PARTS, the unit in which the
  router (`placement.share_parts` / `quotas`) splits an expert's tokens, keeping device loads
  level: floor every share, then give each expert's missing parts one each to its replicas on
  the devices furthest below the mean load (ties: larger fractional part). Experts go in
  `groups` batches, largest part (load_e / SHARE_PARTS tokens) first, with the devices'
  deficits updated between batches; experts whose shares are whole parts already (the
  snapped ones) are left out of the batches.

  With many devices one part of a hot expert is a large slice of a device's load (for E=64 on
  N=1024 the hottest part is ~8% of the mean device load), so leaving the rounding to the
  router's largest-remainder rule costs several percent of balance. share * SHARE_PARTS is an
  integer here, so share_parts reproduces these parts exactly. `base_YxN`: load the devices
  already carry (the tokens replicas keep locally), levelled together with these parts.
  `whole_YxE`: experts whose shares are known to be whole parts summing to SHARE_PARTS (the
  snapped ones, 1/r_e with r_e a power of two <= SHARE_PARTS): their replicas are skipped
  when counting the parts still missing (at N = 4096, 86% of them), and their parts are
  their shares x SHARE_PARTS already. `live`: the flat indices of the other replicas, when
  the caller has them (`level`'s `live_out` for the same grid and mask)."""
  k, n, rounds = grid.shape
  num_experts = len(load_E)
  gflat = expert_index(grid, num_experts)
  exact = share.ravel() * SHARE_PARTS
  if whole_YxE is None:
    parts = np.floor(exact + 1e-9)
    live = np.arange(len(gflat))
    short = SHARE_PARTS - np.bincount(gflat, weights=parts, minlength=k * num_experts)
  else:              # parts are whole numbers, so their sums are exact in any order
    if live is None:
      live = np.flatnonzero((~np.atleast_2d(whole_YxE).ravel()).take(gflat))
    parts = exact.copy()          # whole experts: 1024 / r_e, an integer, which floor keeps
    parts_live = np.floor(exact.take(live) + 1e-9)
    parts[live] = parts_live
    short = SHARE_PARTS - np.bincount(gflat.take(live), weights=parts_live,
                                      minlength=k * num_experts)
  unit = load_E / SHARE_PARTS                                   # tokens per part
  unit_flat = unit.take(grid.ravel())
  dev_load = np.einsum("ir,ir->i", parts.reshape(k * n, rounds), unit_flat.reshape(k * n, rounds))
  mean = np.full(k * n, load_E.sum() / n)
  if base_YxN is not None:
    dev_load += base_YxN.ravel()
    mean += np.repeat(base_YxN.sum(1) / n, n)
  open_ = live[short.take(gflat.take(live)) > 0.5]               # replicas of unfinished experts
  if len(open_) == 0:
    return (parts / SHARE_PARTS).reshape(share.shape)
  frac = exact.take(open_) - parts.take(open_)
  if groups == 1:
    by_group, bounds = np.arange(len(open_)), [0, len(open_)]
  else:
    rank_E = np.empty(num_experts, np.int64)
    rank_E[np.argsort(-unit, kind="stable")] = np.arange(num_experts)
    group = (rank_E * groups // num_experts).take(gflat.take(open_) % num_experts)
    by_group = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[by_group], np.arange(groups + 1)).tolist()
  for b in range(groups):
    pick = by_group[bounds[b]:bounds[b + 1]]
    if len(pick) == 0:
      continue
    sel = open_.take(pick)
    e_sel = gflat.take(sel)
    dev = sel // rounds
    gap = dev_load.take(dev) - mean.take(dev)
    span = 2.0 * float(np.abs(gap).max()) + 1.0
    order = np.argsort(e_sel + (gap - frac.take(pick) * 1e-6) / span)  # by expert, deficit first
    sel, e_sel = sel[order], e_sel[order]
    pos = np.arange(len(sel))
    run = np.empty(len(sel), bool)                      # where each expert's replicas start
    run[0] = True
    np.not_equal(e_sel[1:], e_sel[:-1], out=run[1:])
    first = np.maximum.accumulate(np.where(run, pos, 0))
    up = sel[pos - first < short.take(e_sel)]          # the first `short` of each expert
    parts[up] += 1
    dev_load += np.bincount(up // rounds, weights=unit_flat[up], minlength=k * n)
  return (parts / SHARE_PARTS).reshape(share.shape)
