"""How the fsep planner deals replicas to devices, and the bound that deal order gives before
any candidate is placed (numpy only; the planner's step 1 and its pruning).

  deal(r_candsxE, load_E, n, rounds)
    -> (grid[cands, N, rounds], device loads at even shares [cands, N])
  deal_bound(r_candsxE, coarse_candsxE, load_E, load_stepsxE, dev_NxE, total_N, n, rounds)
    -> (peak, sent)
"""

from __future__ import annotations

import numpy as np

# From this many devices on the planner uses faster arithmetic that changes the last bits of
# some sums and the order of exact ties (decision 0056): column sums over groups of rows,
# a fixed key scale in the deal, a packed-key sort in `quantise`. Below it the sums run in
# the plain order, so the plans of small meshes, which replayed results and tests pin bit for
# bit, do not depend on the shortcuts (decision 0061).
LARGE_MESH = 256


def deal(r_candsxE: np.ndarray, load_E: np.ndarray, n: int, rounds: int
         ) -> tuple[np.ndarray, np.ndarray]:
  """(grid[cands, N, rounds] of experts, each device's load [cands, N] at even shares, summed
  round by round) for Y candidate replica counts r_candsxE (each summing to
  N * rounds, each count in [1, N]): replicas sorted by per-replica load (load_e / r_e, desc)
  are dealt in rounds of N, the round's largest replica to the currently least-loaded device,
  one per device per round.

  Replicas of an expert are contiguous in that order and number <= N, so an expert spans at
  most two rounds and only the first expert of a round can already sit on some devices (from
  the round before); devices holding it go last in that round (after all others by load), so
  its replicas land on the least-loaded devices that lack it: at most one replica of an expert
  per device, by construction. The Y candidates are dealt together (one numpy call per round
  and step for all of them)."""
  r_candsxE = np.atleast_2d(r_candsxE)
  k, num_experts = r_candsxE.shape
  per_candsxE = load_E[None, :] / r_candsxE
  reps = np.empty((k, rounds, n), np.int64)
  per = np.empty((k, rounds, n))                          # per-replica load of each replica
  held_from = np.full((k, rounds), n)      # round j - 1's first position holding round j's
  for i in range(k):                       # first expert (n: none); Y <= 3
    order = np.argsort(-per_candsxE[i], kind="stable")        # per-replica load desc, then id
    r_sorted = r_candsxE[i].take(order)
    reps[i] = np.repeat(order, r_sorted).reshape(rounds, n)
    per[i] = np.repeat(per_candsxE[i].take(order), r_sorted).reshape(rounds, n)
    ends = np.cumsum(r_sorted)
    bounds = np.arange(1, rounds) * n                     # where rounds 1.. start
    at = np.searchsorted(ends, bounds, side="right")      # their first experts
    start = ends.take(at) - r_sorted.take(at)
    held_from[i, 1:] = np.where(start < bounds, start - bounds + n, n)
  if n >= LARGE_MESH:          # more than any device load (its replicas' loads add up to
    last = 2.0 * float(load_E.sum()) + 1.0    # the expert loads at most), and above any key
    top = 2.0 * last
  else:
    last = 2.0 * float(np.einsum("kjn->k", per).max()) + 1.0
    top = None                                  # each round's max
  held = [[(i, int(held_from[i, j])) for i in range(k) if held_from[i, j] < n]
          for j in range(rounds)]
  cols = np.arange(n)
  # Devices are kept in the order of the round's deal (position i takes the round's i-th
  # largest replica), so a round is one add, one sort and one write of its experts.
  perm = np.tile(np.arange(n), (k, 1))                  # device at each position
  load = np.zeros((k, n))                                # its load so far
  grid = np.empty((k, n, rounds), np.int64)
  rows = np.arange(k)[:, None]
  for j in range(rounds):
    for i in range(k):
      grid[i, :, j][perm[i]] = reps[i, j]
    load += per[:, j]
    if j + 1 == rounds:
      break
    key = load
    if held[j + 1]:          # who just got the expert that goes on in round j + 1: a suffix
      key = load.copy()
      for i, start in held[j + 1]:
        key[i, start:] += last
    idx = ascending(key, cols, top)
    if k > 1:
      idx += rows * n                                   # into the flattened [cands, N] arrays
    perm = perm.take(idx)                               # `take` flattens, keeps idx's shape
    load = load.take(idx)
  load_candsxN = np.empty((k, n))
  np.put_along_axis(load_candsxN, perm, load, axis=1)       # back to device order
  return grid, load_candsxN


def ascending(key_candsxN: np.ndarray, cols: np.ndarray | None = None,
              top: float | None = None) -> np.ndarray:
  """Per row, the column order of non-negative keys, ascending, ties to the lower column (keys
  closer than top / 2**(62 - log2 N) count as ties; `top`: at least the largest key, its
  max by default; the deal passes a bound it knows instead of finding the max each round).
  The column is packed into the low bits of an int64 key so that a plain sort does it (about
  twice as fast as argsort). The keys of one round of the deal are a few dozen ascending runs
  (devices sorted by load, each run given the same replica), which the stable sort (timsort)
  merges faster than the default quicksort.
  `cols`: np.arange(N), when the caller has it."""
  bits = max(1, (key_candsxN.shape[1] - 1).bit_length())
  top = float(key_candsxN.max()) if top is None else top
  scale = float(2 ** (62 - bits)) / (top * 1.001) if top > 0 else 0.0
  packed = (key_candsxN * scale).astype(np.int64)
  packed <<= bits
  packed |= np.arange(key_candsxN.shape[1]) if cols is None else cols
  packed.sort(axis=1, kind="stable")      # keys are unique; the deal's are sorted runs
  packed &= (1 << bits) - 1
  return packed


def deal_bound(r_candsxE, coarse_candsxE, load_E, load_stepsxE, dev_NxE, total_N, n, rounds):
  """(busiest device's load, most rows a device sends) [cands]: lower bounds on what
  `planner.peaks` scores for each candidate, before it is placed. `deal` deals the replicas, sorted
  by per-replica load, in rounds of one per device, so every device carries one replica of each
  round: the device given round j's heaviest snapped replica (its share fixed at 1/r_e) carries at
  least that plus the lightest of every other round (unsnapped ones count as 0: their shares may
  shrink); and the busiest carries at least the mean. With a window (load_stepsxE [steps, E]) per
  step and averaged. Rows sent: the device with the most tokens keeps at most its `rounds` largest
  own counts (times 1/r_e where snapped)."""
  loads = load_E[None] if load_stepsxE is None else load_stepsxE
  k, num_experts = r_candsxE.shape
  peak, sent = np.empty(k), np.empty(k)
  d = int(np.argmax(total_N))
  mean_steps = loads.sum(1) / n
  js = np.arange(rounds)
  for y in range(k):                                      # Y <= 3
    r_E = r_candsxE[y]
    order = np.argsort(-(load_E / r_E), kind="stable")   # the order `deal` deals
    r_sorted = r_E.take(order)
    ends = np.cumsum(r_sorted)                           # expert i's replicas end there
    first_round, last_round = (ends - r_sorted) // n, (ends - 1) // n
    fixed_stepsxE = np.where(coarse_candsxE[y], loads / r_E, 0.0)[:, order]
    # Round j holds the experts i in [a_j, b_j) of the deal order (both rounds rise with i).
    ab = np.empty(2 * rounds, np.int64)
    ab[0::2] = np.searchsorted(last_round, js)
    ab[1::2] = np.searchsorted(first_round, js, side="right")
    padded = np.zeros((len(loads), num_experts + 1))      # b_j may be E
    padded[:, :num_experts] = fixed_stepsxE
    lo = np.ascontiguousarray(np.minimum.reduceat(padded, ab, axis=1)[:, 0::2])
    hi = np.maximum.reduceat(padded, ab, axis=1)[:, 0::2]
    best = (hi + lo.sum(1, keepdims=True) - lo).max(1)
    peak[y] = np.maximum(best, mean_steps).mean()
    keep = dev_NxE[d] * np.where(coarse_candsxE[y], 1.0 / r_E, 1.0)
    sent[y] = total_N[d] - np.sort(keep)[-rounds:].sum()
  return peak, sent
