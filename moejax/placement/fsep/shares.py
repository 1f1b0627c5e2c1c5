"""Token shares of the fsep planner's placed candidates: levelling and rounding (numpy only).

Candidates are Y layouts grid[cands, N, rounds] (the expert of each replica, at most one per
(device, expert)); shares are [cands, N, rounds] and sum to 1 per expert and candidate. Both steps
work on a flat list of the replicas that can still change: at N = 4096, E = 256, C = 8 the
experts snapped to even power-of-two shares (counts.snap_counts) hold ~86% of the replicas, so
the other 14% are all that levelling and rounding touch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moejax.layout.host_layout import SHARE_PARTS
from moejax.placement.fsep.deal import LARGE_MESH


def expert_index(grid: np.ndarray, num_experts: int) -> np.ndarray:
  """[cands * N * rounds]: each replica's expert, offset by E per candidate (one table of all Y)."""
  k = grid.shape[0]
  if k == 1:                                 # the common case: no offsets to add
    return grid.reshape(-1)
  return (grid + (np.arange(k) * num_experts)[:, None, None]).ravel()


class Levelled(NamedTuple):
  """What `levelled` returns; the last three are None where no expert is frozen."""
  share: np.ndarray                 # [cands, N, rounds]
  live: np.ndarray | None           # flat indices of the replicas of experts not frozen
  fixed_candsxN: np.ndarray | None      # each device's load from its frozen replicas
  peak_cands: np.ndarray | None         # the busiest device's load under `share`


def levelled(grid: np.ndarray, r_candsxE: np.ndarray, load_E: np.ndarray, iters: int,
             frozen_candsxE: np.ndarray | None = None, alpha: float = 1.5,
             tol: float = 1e-3, even_candsxN: np.ndarray | None = None) -> Levelled:
  """Token shares [cands, N, rounds] of the replicas in grid[cands, N, rounds]. They start even
  (1/r_e); the replicas of experts not frozen (see snap_counts) are levelled towards equal
  device loads by up to `iters` Sinkhorn steps: each share is scaled by (its device's target /
  its device's levelled load) ** alpha, the target being the mean load less the device's
  frozen replicas' load (ratio clipped to [1/16, 16]; alpha > 1 over-relaxes, converging in a
  few steps where plain Sinkhorn needs tens), then renormalised per expert. Each step starts
  from the candidate's best shares so far (lowest busiest device), and a candidate whose step
  did not improve falls back to alpha = 1; stops early once every candidate is within `tol`
  of the mean or none improves any more.

  Where experts are frozen it also returns what it has at hand for the callers: the flat
  indices of the other replicas (what `quantise` rounds), the devices' frozen loads, and the
  busiest device's load (frozen + levelled), so that scoring and rounding need no second
  pass over all N x rounds replicas (at N = 4096 the frozen ones are 86% of 32,768).
  `even_candsxN`: each device's load at even shares (`deal.deal`'s); the frozen loads are
  then that less the other replicas' even loads, not a gather and sum over every replica."""
  r_candsxE = np.atleast_2d(r_candsxE)
  k, n, rounds = grid.shape
  num_experts = len(load_E)
  gflat = expert_index(grid, num_experts)
  share = (1.0 / r_candsxE.ravel()).take(gflat)
  mean = load_E.sum() / n
  if mean <= 0 or iters < 1:
    return Levelled(share.reshape(grid.shape), None, None, None)
  fixed = np.zeros(k * n)
  frozen = frozen_candsxE is not None and frozen_candsxE.any()
  if frozen:
    frozen_E = np.atleast_2d(frozen_candsxE).ravel()
    live = np.flatnonzero((~frozen_E).take(gflat))
  else:
    live = np.arange(len(gflat))
  g = gflat.take(live)
  d = live // rounds                                          # candidate-major device ids
  w = (load_E if k == 1 else np.tile(load_E, k)).take(g)
  cand = d // n if k > 1 else None
  best = share[live]
  best_load = np.bincount(d, weights=best * w, minlength=k * n)
  if frozen and even_candsxN is not None:    # the deal's loads less the live replicas' (>= 0:
    fixed = np.maximum(even_candsxN.ravel() - best_load, 0.0)     # rounding at devices of none)
  elif frozen:
    per_E = np.where(frozen_E, np.tile(load_E, k) / r_candsxE.ravel(), 0.0)
    fixed = np.einsum("ir->i", per_E.take(gflat).reshape(k * n, rounds))  # stay 1/r_e
  target = np.maximum(mean - fixed, mean * 1e-6)
  a = np.full(k, float(alpha))
  best_peak = (best_load + fixed).reshape(k, n).max(1)
  for _ in range(iters):
    if np.all(best_peak <= mean * (1 + tol)):
      break
    ratio = np.clip(target / np.maximum(best_load, 1e-300), 1.0 / 16, 16.0)
    s = best * ratio.take(d) ** (a.take(cand) if k > 1 else float(a[0]))  # same loop, same bits
    s /= np.bincount(g, weights=s, minlength=k * num_experts).take(g)
    dev_load = np.bincount(d, weights=s * w, minlength=k * n)
    peak = (dev_load + fixed).reshape(k, n).max(1)
    better = peak < best_peak - mean * 1e-4
    if not better.any() and np.all(a == 1.0):
      break
    if k == 1:                           # the same choice without the per-replica selects
      if better[0]:
        best, best_load, best_peak = s, dev_load, peak
    else:
      best = np.where(better.take(cand), s, best)
      best_load = np.where(np.repeat(better, n), dev_load, best_load)
      best_peak = np.where(better, peak, best_peak)
    a[~better] = 1.0                     # overshot: retry from the best with plain Sinkhorn
  share[live] = best
  if not frozen:
    return Levelled(share.reshape(grid.shape), None, None, None)
  return Levelled(share.reshape(grid.shape), live, fixed.reshape(k, n), best_peak)


def quantise(grid: np.ndarray, share: np.ndarray, load_E: np.ndarray,
             groups: int = 8, base_candsxN: np.ndarray | None = None,
             whole_candsxE: np.ndarray | None = None, live: np.ndarray | None = None,
             fixed_candsxN: np.ndarray | None = None) -> np.ndarray:
  """Shares [cands, N, rounds] rounded to whole parts of SHARE_PARTS, the unit in which the
  router (`placement.share_parts` / `quotas`) splits an expert's tokens, keeping device loads
  level: floor every share, then give each expert's missing parts one each to its replicas on
  the devices furthest below the mean load (ties: larger fractional part). Experts go in
  `groups` batches, largest part (load_e / SHARE_PARTS tokens) first, with the devices'
  deficits updated between batches; experts whose shares are whole parts already (the
  snapped ones) are left out of the batches.

  With many devices one part of a hot expert is a large slice of a device's load (for E=64 on
  N=1024 the hottest part is ~8% of the mean device load), so leaving the rounding to the
  router's largest-remainder rule costs several percent of balance. share * SHARE_PARTS is an
  integer here, so share_parts reproduces these parts exactly. `base_candsxN`: load the devices
  already carry (the tokens replicas keep locally), levelled together with these parts.
  `whole_candsxE`: experts whose shares are known to be whole parts summing to SHARE_PARTS (the
  snapped ones, 1/r_e with r_e a power of two <= SHARE_PARTS): their replicas are skipped
  when counting the parts still missing (at N = 4096, 86% of them), and their parts are
  their shares x SHARE_PARTS already. `live`, `fixed_candsxN`: the flat indices of the other
  replicas and each device's load from the whole ones, when the caller has them (`levelled`
  on the same grid and mask): the devices' loads are then that plus the other replicas'
  parts, not a sum over every replica (each whole replica's parts x tokens per part is
  load_e / r_e exactly, so only the order of the sum differs)."""
  k, n, rounds = grid.shape
  num_experts = len(load_E)
  gflat = expert_index(grid, num_experts)
  flat = share.ravel()
  if whole_candsxE is None:           # every replica is rounded; arrays below are over `live`
    live, g_live = np.arange(len(gflat)), gflat
    exact = flat * SHARE_PARTS
  else:                           # whole ones keep their shares: 1024 / r_e parts already
    if live is None:
      live = np.flatnonzero((~np.atleast_2d(whole_candsxE).ravel()).take(gflat))
    g_live = gflat.take(live)
    exact = flat.take(live) * SHARE_PARTS
  parts = np.floor(exact + 1e-9)
  # parts are whole numbers, so their sums are exact in any order
  short = SHARE_PARTS - np.bincount(g_live, weights=parts, minlength=k * num_experts)
  unit = load_E / SHARE_PARTS                                   # tokens per part
  expert = grid.reshape(-1)                                      # without candidate offsets
  if whole_candsxE is not None and fixed_candsxN is not None:
    dev_load = fixed_candsxN.ravel() + np.bincount(
        live // rounds, weights=parts * unit.take(expert.take(live)), minlength=k * n)
  else:
    parts_all = parts
    if whole_candsxE is not None:
      parts_all = flat * SHARE_PARTS
      parts_all[live] = parts
    dev_load = np.einsum("ir,ir->i", parts_all.reshape(k * n, rounds),
                         unit.take(expert).reshape(k * n, rounds))
  mean_D = np.full(k * n, load_E.sum() / n)                    # each device's level
  if base_candsxN is not None:
    dev_load += base_candsxN.ravel()
    mean_D += np.repeat(base_candsxN.sum(1) / n, n)
  open_pos = np.flatnonzero(short.take(g_live) > 0.5)   # (in `live`) of unfinished experts
  if len(open_pos):
    frac = exact.take(open_pos) - parts.take(open_pos)
    if groups == 1:
      by_group, bounds = np.arange(len(open_pos)), [0, len(open_pos)]
    else:
      rank_E = np.empty(num_experts, np.int64)
      rank_E[np.argsort(-unit, kind="stable")] = np.arange(num_experts)
      group = (rank_E * groups // num_experts).take(g_live.take(open_pos) % num_experts)
      by_group = np.argsort(group, kind="stable")
      bounds = np.searchsorted(group[by_group], np.arange(groups + 1)).tolist()
    for b in range(groups):
      pick = by_group[bounds[b]:bounds[b + 1]]
      if len(pick) == 0:
        continue
      at = open_pos.take(pick)
      e_sel = g_live.take(at)
      dev = live.take(at) // rounds
      gap = dev_load.take(dev) - mean_D.take(dev)
      key = gap - frac.take(pick) * 1e-6                         # deficit first
      if n >= LARGE_MESH:
        order = by_expert_then(e_sel, key)
      else:                       # argsort: ties in whatever order numpy's sort leaves them
        order = np.argsort(e_sel + key / (2.0 * float(np.abs(gap).max()) + 1.0))
      at, e_sel = at.take(order), e_sel.take(order)
      pos = np.arange(len(at))
      run = np.empty(len(at), bool)                     # where each expert's replicas start
      run[0] = True
      np.not_equal(e_sel[1:], e_sel[:-1], out=run[1:])
      first = np.maximum.accumulate(np.where(run, pos, 0))
      up = at[pos - first < short.take(e_sel)]          # the first `short` of each expert
      parts[up] += 1
      up = live.take(up)
      dev_load += np.bincount(up // rounds, weights=unit.take(expert.take(up)),
                              minlength=k * n)
  if whole_candsxE is None:
    return (parts / SHARE_PARTS).reshape(share.shape)
  out = flat.copy()
  out[live] = parts / SHARE_PARTS
  return out.reshape(share.shape)


_ODD, _SALT = 0x9E3779B1, 0x85EBCA77       # odd multipliers: bijections modulo 2**bits


def tie_rank(e_sel: np.ndarray, bits: int) -> np.ndarray:
  """[m]: position p's rank among exact ties, ((p + salt_e) x odd) mod 2**bits (m <= 2**bits):
  distinct within an expert, and scrambled differently per expert, so that one batch of
  experts does not give all its tied parts to the same devices (lowest position first did:
  at N = 4096 it left the busiest device 0.1% higher than numpy's argsort)."""
  mask = (1 << bits) - 1
  return ((np.arange(len(e_sel)) + ((e_sel * _SALT) & mask)) * _ODD) & mask


def by_expert_then(e_sel: np.ndarray, key: np.ndarray) -> np.ndarray:
  """The order of the replicas by expert id, then by `key` ascending, then by `tie_rank`: one
  int64 sort (expert | key scaled to the bits left | tie rank) instead of an argsort of
  floats, ~3x as fast at 4,600 replicas; keys closer than their range / 2**(bits left)
  (2**41 at N = 4096, E = 256) count as ties. The position comes back from the tie rank."""
  m = len(e_sel)
  pos_bits = max(1, (m - 1).bit_length())
  e_bits = max(1, int(e_sel.max()).bit_length())
  key_bits = 62 - pos_bits - e_bits
  lo = float(key.min())
  width = float(key.max()) - lo
  scale = float(2 ** key_bits - 1) / width if width > 0 else 0.0
  packed = e_sel << key_bits
  packed |= ((key - lo) * scale).astype(np.int64)
  packed <<= pos_bits
  packed |= tie_rank(e_sel, pos_bits)
  packed.sort()
  mask = (1 << pos_bits) - 1
  expert = packed >> (key_bits + pos_bits)
  packed &= mask                                # (p + salt) x odd -> p
  packed *= pow(_ODD, -1, 1 << pos_bits)
  packed -= (expert * _SALT) & mask
  packed &= mask
  return packed
