"""FSEP placement (LAER-MoE style): replicas of hot experts, any layout every step.

In FSEP mode every expert's weights are sharded 1/N over all N devices and each step restores
the experts of the layout in use, so a layout may hold several replicas of an expert and may
change every step at no extra cost. Every slot hosts an expert (all N*C of them when C <= E;
with C > E every device holds all E and the rest stay empty), and an expert has at most one
replica per device, so at most N replicas (the in-graph router relies on it).

  place_replicas(pred_WxE, current, *, slots, src_dev_W, cost, num_devices, options)
    -> Placement

Sources are folded onto their devices first. Each candidate replica count (`even`: N*C // E
each, the remainder to the hottest experts; `dhondt`: highest-averages apportionment of the
slots by predicted load, every expert >= 1 and <= N; `blend`, optional: the same on load +
mean load) goes through:
  0. snap: experts whose tokens the router could only split coarsely (fewer than 16 parts
     of SHARE_PARTS per replica, or one part > 2% of a device's mean load) get a power-of-two
     replica count and even shares, so their parts are exact; the rest are re-apportioned;
  1. place: replicas sorted by per-replica load (load_e / r_e) descending are dealt in C rounds
     of N, the round's largest replica to the currently least-loaded device, one per device per
     round (devices already holding the expert that straddles two rounds go last);
  2. split: token shares start even (1/r_e); the other experts' shares are levelled by a few
     over-relaxed Sinkhorn steps (scale by (device target / device load) ** 1.5, renormalise
     per expert, keep the best step);
  3. score (with plan_for='spread' and a window, on the busiest device averaged over the
     window's steps, with candidates also apportioned to its last step and mean + std:
     moejax.placement.spread): cost.compute_s(max device load) + cost.exchange_s(max sent off
     a device) under the dense dispatch's split routing on the predicted counts (each source
     splits its tokens for e over e's replicas by their shares; `estimate`). With
     `capacity_factor` (the dense dispatch: fixed rows per (source, slot) pair),
     candidates within `TIME_SLACK` of the best score are told apart by their overflow of
     those rows on the mean counts (`overflow`): device loads alone can tie while one
     layout overflows its slots much further than another. Time decides first because a
     planner that put overflow first did not drop fewer choices in training.
The best candidate's shares are then rounded to whole parts of SHARE_PARTS, the router's
unit, towards level device loads (`quantise`), so what replay and the device router realise
is what was planned; then each device keeps its own tokens on its own replicas first
(per-source shares, moejax.placement.locality). Before step 1 each candidate gets a lower
bound on its score from the deal order alone (`fsep_deal.deal_bound`); the one with the
lowest bound is placed and scored first, and another only if its bound comes within
TIME_SLACK of that score, so pruning changes no choice (the first one's rows sent are
scored only where they could admit another, `_first_sent`). With plan_for='spread' and a
window the load levelled on is each expert's median share over the window's last
`center_steps` steps (spread.recent_center; center='mean' keeps the window mean). Python
loops run only over candidates, the C rounds, levelling steps and rounding batches. From
fsep_deal.LARGE_MESH devices on, some sums run in other orders and exact ties in rounding
go by a stated rank (decision 0056); below it the plans are decision 0049's bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from moejax.config import ConfigError
from moejax.layout.placement import SHARE_PARTS, Placement
from moejax.placement.cost import CostModel
from moejax.placement.fsep_deal import deal, deal_bound as _deal_bound
from moejax.placement.fsep_score import (
  column_sums,
  device_load,
  estimate,
  fold_sources,
  overflow,
  own_counts,
)
from moejax.placement.fsep_shares import levelled, quantise
from moejax.placement.locality import keep_local, local_parts
from moejax.placement.spread import hedge_loads, mean_peak, recent_center, window_loads

TIME_SLACK = 0.01     # relative score within which the dense dispatch's overflow decides
CANDIDATES = ("even", "dhondt", "blend")      # every kind `replica_counts` knows
DEFAULT_CANDIDATES = ("even", "dhondt")
PLAN_FOR = ("spread", "mean")
CENTERS = ("median", "mean")


def even_counts(load_E: np.ndarray, total: int) -> np.ndarray:
  """`total` // E replicas each, one more for the (total % E) hottest experts."""
  num_experts = len(load_E)
  r = np.full(num_experts, total // num_experts, np.int64)
  rem = total % num_experts
  if rem:
    r[np.argsort(-load_E, kind="stable")[:rem]] += 1
  return r


def _top_values(load_E: np.ndarray, first_k: np.ndarray, cap: int, take: int) -> np.ndarray:
  """How many of each expert's next values load_e / k, k = first_k[e], first_k[e] + 1, ...
  (k <= cap) are among the `take` largest of all of them; ties to the lower expert id.

  Only values at or above a lower bound on the take-th largest are built: the take-th largest
  of the experts' first values (one per expert) is one, since those are among all the values.
  At E = 256, N = 4096 that is ~1.3 x take values instead of E x take."""
  num_experts = len(load_E)
  m = min(take, cap)
  first = np.where(first_k <= cap, load_E / first_k, -np.inf)
  low = np.partition(first, num_experts - take)[num_experts - take] if take <= num_experts else 0.0
  count_E = np.minimum(cap + 1 - first_k, m)                            # values k <= cap
  if low > 0:                            # and load_e / k >= low: k <= load_e / low (+1: slack)
    count_E = np.minimum(count_E, np.minimum(np.floor(load_E / low), m + first_k) + 2 - first_k)
  count_E = np.maximum(count_E, 0).astype(np.int64)
  expert = np.repeat(np.arange(num_experts), count_E)                  # expert-major, k rising
  starts = np.cumsum(count_E) - count_E
  ks = first_k.take(expert) + (np.arange(len(expert)) - starts.take(expert))
  vals = load_E.take(expert) / ks
  top = np.argpartition(-vals, take - 1)[:take]
  thresh = vals[top].min()
  chosen = vals > thresh
  ties = np.flatnonzero(vals == thresh)[:take - int(chosen.sum())]   # expert-major order
  chosen[ties] = True
  return np.bincount(expert[chosen], minlength=num_experts)


def dhondt_counts(load_E: np.ndarray, total: int, cap: int) -> np.ndarray:
  """Highest averages (D'Hondt): every expert gets 1, each further replica goes to the expert
  with the largest load_e / r_e, at most `cap` per expert, `total` (<= E * cap) in all.

  Equivalent to taking the (total - E) largest values load_e / k, k = 2..cap, without building
  all E x cap of them: every value above total_load / total is taken (there are at most
  total - E of those), and only the few still missing are picked from each expert's next ones."""
  load_E = np.asarray(load_E, np.float64)
  num_experts = len(load_E)
  extra = total - num_experts
  if extra <= 0 or cap <= 1:
    return np.ones(num_experts, np.int64)
  if extra >= num_experts * (cap - 1):
    return np.full(num_experts, cap, np.int64)
  mass = load_E.sum()
  if mass <= 0:
    return even_counts(load_E, total)
  lam = mass / total * (1 + 1e-9)
  # Values load_e / k > lam for k in 2..cap: k < load_e / lam.
  above = np.clip(np.ceil(load_E / lam) - 2, 0, cap - 1).astype(np.int64)
  if above.sum() > extra:                                   # cannot happen; stay exact anyway
    above[:] = 0
  r = 1 + above
  missing = extra - int(above.sum())
  if missing > 0:
    r += _top_values(load_E, r + 1, cap, missing)
  return r


def replica_counts(kind: str, load_E: np.ndarray, total: int, cap: int) -> np.ndarray:
  if kind == "even":
    return even_counts(load_E, total)
  if kind == "dhondt":
    return dhondt_counts(load_E, total, cap)
  if kind == "blend":
    return dhondt_counts(load_E + load_E.mean(), total, cap)
  raise ConfigError(f"fsep candidate {kind!r} is unknown; choose from {list(CANDIDATES)}.")


def snap_counts(r_E: np.ndarray, load_E: np.ndarray, total: int, cap: int,
                min_parts: int = 16, max_part: float = 0.02,
                kind: str = "dhondt") -> tuple[np.ndarray, np.ndarray]:
  """(replica counts, coarse mask [E]). The router splits an expert's tokens in whole parts of
  SHARE_PARTS; an expert with fewer than `min_parts` parts per replica, or one part above
  `max_part` of the mean device load ("coarse": a hot expert on many devices), cannot have its
  shares levelled finely, and rounding them costs balance (on N=1024 one part of the hottest
  expert is several percent of a device's load). Coarse experts therefore get the power-of-two
  replica count nearest theirs (at most min(cap, SHARE_PARTS); cap = N devices), so even
  shares are whole parts, and keep even shares; if that changes their total, the other
  experts are re-apportioned by the same rule (`kind`) over the remaining slots. Returns the
  counts unchanged and no coarse expert when that is impossible."""
  mean = load_E.sum() / cap
  coarse = (r_E * min_parts > SHARE_PARTS) | (load_E / SHARE_PARTS > max_part * mean)
  none = np.zeros(len(r_E), bool)
  if not coarse.any():
    return r_E, none
  top = 1 << (min(cap, SHARE_PARTS).bit_length() - 1)       # largest power of 2 allowed
  rc = r_E[coarse]
  lo = np.left_shift(1, np.floor(np.log2(rc)).astype(np.int64))
  snapped = np.minimum(np.where(rc - lo <= 2 * lo - rc, lo, 2 * lo), top)
  if np.array_equal(snapped, rc):
    return r_E, coarse
  fine = ~coarse
  rest = total - int(snapped.sum())
  if not int(fine.sum()) <= rest <= int(fine.sum()) * cap:
    return r_E, none
  out = r_E.copy()
  out[coarse] = snapped
  if fine.any():
    out[fine] = replica_counts(kind, load_E[fine], rest, cap)
  return out, coarse


@dataclasses.dataclass(frozen=True)
class FsepOptions:
  candidates: tuple[str, ...] = DEFAULT_CANDIDATES   # replica-count rules tried (CANDIDATES)
  level_iters: int = 3                 # Sinkhorn steps levelling the shares
  exact_parts: bool = True             # snap and round shares to the router's parts
  quantise_groups: int = 1             # expert batches in `quantise`
  min_parts: int = 16                  # `snap_counts`: parts per replica below which ...
  max_part: float = 0.02               # ... or one part above this share of a device: coarse
  capacity_factor: float | None = None  # the dense dispatch's (None: dropless, time decides)
  locality: bool = True                # per-source shares: own tokens to own replica first
  local_min_rows: float = 128.0        # ... for experts with at least this many rows per device
  plan_for: str = "spread"             # or "mean": today's plan for the window's mean load
  center: str = "median"               # spread: level on the recent median share, or "mean"
  center_steps: int = 5                # ... over the window's last this many steps


def place_replicas(pred_WxE: np.ndarray, current: Placement, *, slots: int,
                   src_dev_W: np.ndarray, cost: CostModel | None = None,
                   num_devices: int | None = None,
                   options: FsepOptions = FsepOptions(),
                   samples_stepsxWxE: np.ndarray | None = None) -> Placement:
  """One MoE layer's FSEP layout for the predicted counts pred_WxE (see the module doc).
  `current` is not needed (a layout change is free in FSEP); only its num_devices is used when
  num_devices is not given. options.exact_parts=False skips snapping and rounding to router
  parts (faster, but on N >= 256 the router's own rounding then costs a few percent of
  balance). `samples_stepsxWxE`: the finished steps pred_WxE averages, which plan_for='spread'
  plans for (moejax.placement.spread); without two or more it plans for the mean."""
  o = options
  if o.plan_for not in PLAN_FOR:
    raise ConfigError(f"fsep plan_for={o.plan_for!r} is unknown; choose one of {PLAN_FOR}.")
  if o.center not in CENTERS or o.center_steps < 1:
    raise ConfigError(f"fsep center={o.center!r}, center_steps={o.center_steps}: choose center "
                      f"from {CENTERS} and center_steps >= 1.")
  pred = np.asarray(pred_WxE, np.float64)
  num_experts = pred.shape[1]
  n = int(num_devices or current.num_devices)
  c = int(slots)
  if c < 1 or n * c < num_experts:
    raise ConfigError(f"fsep needs N*C >= E slots for E={num_experts} experts, got N={n} "
                      f"devices x C={c} slots = {n * max(c, 0)}; set slots per device to at "
                      f"least ceil(E/N)={-(-num_experts // n)}.")
  cost = cost or CostModel()
  spread = (o.plan_for == "spread" and samples_stepsxWxE is not None and len(samples_stepsxWxE) > 1)
  if spread and o.center == "median":
    pred = recent_center(pred, samples_stepsxWxE, o.center_steps)
  dev_NxE = fold_sources(pred, src_dev_W, n)
  load_E = column_sums(dev_NxE)
  rounds = min(c, num_experts)              # more than E slots: every device holds all E
  total = n * rounds
  load_stepsxE = window_loads(samples_stepsxWxE, src_dev_W, n, load_E.sum()) if spread else None
  targets = [load_E] + (hedge_loads(load_stepsxE) if spread else [])
  counts = {}
  for kind, target in itertools.product(o.candidates, targets):
    r_E = replica_counts(kind, target, total, n)
    coarse_E = np.zeros(num_experts, bool)
    if o.exact_parts:
      r_E, coarse_E = snap_counts(r_E, load_E, total, n, o.min_parts, o.max_part, kind)
    counts.setdefault(r_E.tobytes(), (r_E, coarse_E))      # duplicates evaluated once
  r_candsxE = np.stack([r for r, _ in counts.values()])
  coarse_candsxE = np.stack([m for _, m in counts.values()])
  total_N = np.einsum("ne->n", dev_NxE)
  cap_N = None if o.capacity_factor is None else o.capacity_factor * total_N / (n * c)
  peak_of = functools.partial(_peaks, load_E=load_E, load_stepsxE=load_stepsxE, dev_NxE=dev_NxE,
                              total_N=total_N, n=n, rounds=rounds, iters=o.level_iters)
  # The candidate with the lowest bound on its score first; the others only where their
  # bound does not already rule them out, before they are placed (at N = 4096 'even' snaps
  # every expert to even shares, and its bound, 1.6x the mean load, rules it out). Bounds
  # are checked against the score before it is tie-broken, so pruning changes no choice.
  peak_lo, sent_lo = _deal_bound(r_candsxE, coarse_candsxE, load_E, load_stepsxE, dev_NxE,
                                 total_N, n, rounds)
  bound_s = np.array([cost.compute_s(float(b)) + cost.exchange_s(float(x))
                      for b, x in zip(peak_lo, sent_lo)])
  first = [int(np.argmin(bound_s))]
  lev = []                                  # the first candidate's levelling, for `quantise`
  grid, share, peak, _ = peak_of(r_candsxE[first], coarse_candsxE[first], sent_too=False,
                                 levelled_out=lev)
  sent = _first_sent(grid, share, peak, bound_s, first[0], cost, dev_NxE, load_E, total_N)
  first_s = cost.compute_s(float(peak[0])) + cost.exchange_s(float(sent[0]))
  rest = [y for y in range(len(r_candsxE)) if y != first[0]
          and bound_s[y] <= first_s * (1 + TIME_SLACK)]
  if rest:
    lev = []
    more = peak_of(r_candsxE[rest], coarse_candsxE[rest])
    order = np.argsort(first + rest, kind="stable")           # candidates in their given order
    grid, share, peak, sent = (np.concatenate([a, b])[order]
                               for a, b in zip((grid, share, peak, sent), more))
  kept_y = sorted(first + rest)
  step_s = [cost.compute_s(float(a)) + cost.exchange_s(float(b)) for a, b in zip(peak, sent)]
  if o.capacity_factor is not None:
    dropped = overflow(grid, share, dev_NxE, cap_N)
    close = np.asarray(step_s) <= min(step_s) * (1 + TIME_SLACK)
    best = int(min(np.flatnonzero(close), key=lambda k: (dropped[k], step_s[k])))
  else:
    best = int(np.argmin(step_s))
  coarse_E = coarse_candsxE[kept_y[best]]
  grid = grid[best]
  share = share[best]
  if o.exact_parts:
    live, fixed = (lev[0].live, lev[0].fixed_candsxN) if lev else (None, None)
    share = quantise(grid[None], share[None], load_E, o.quantise_groups,  # `level` kept
                     whole_candsxE=coarse_E[None], live=live, fixed_candsxN=fixed)[0]  # them 1/r_e
  if c == rounds:
    slot_expert, slot_share = grid.astype(np.int32), share
  else:
    slot_expert = np.full((n, c), -1, np.int32)
    slot_share = np.zeros((n, c))
    slot_expert[:, :rounds] = grid
    slot_share[:, :rounds] = share
  local = None
  plain_E = coarse_E | (load_E < o.local_min_rows * n)
  if o.locality and not plain_E.all():   # coarse experts, and those with few rows per device,
    share, local = _per_source(grid, share, dev_NxE, load_E, cap_N, plain_E, o)  # keep the split
    slot_share[:, :rounds] = share
    local = np.pad(local, ((0, 0), (0, c - rounds))).ravel()
  return Placement(slot_expert.ravel(), slot_share.ravel(), n, routing="split", local=local)


def _first_sent(grid, share, peak, bound_s, first, cost, dev_NxE, load_E, total_N):
  """[1]: the first candidate's most rows sent by a device, or, where it cannot matter, the
  bound it stands for. A device sends at most all its tokens: if even that admits no other
  candidate (every other bound above the first's score + TIME_SLACK), the rows sent (a gather
  of every replica's own count from the [N, E] counts) decide nothing, as at N = 4096."""
  most_s = cost.compute_s(float(peak[0])) + cost.exchange_s(float(total_N.max()))
  if any(b <= most_s * (1 + TIME_SLACK) for y, b in enumerate(bound_s.tolist()) if y != first):
    return estimate(grid, share, dev_NxE, load_E, total_N=total_N)[1].max(1)
  return np.array([total_N.max()])


def _peaks(r_candsxE, coarse_candsxE, *, load_E, load_stepsxE, dev_NxE, total_N, n, rounds, iters,
           sent_too=True, levelled_out=None):
  """(grid, shares, score load, max sent) [Y, ...] of candidate replica counts r_candsxE: placed,
  levelled, scored on the busiest device (averaged over the window's steps when given).
  sent_too=False: max sent is None (not computed). `levelled_out`: a list that receives
  `fsep_shares.levelled`'s answer (for `quantise`). With snapped experts the busiest device
  is `levelled`'s own figure (snapped loads + the levelled rest), not a second sum over
  every replica."""
  grid, even_candsxN = deal(r_candsxE, load_E, n, rounds)
  lev = levelled(grid, r_candsxE, load_E, iters, coarse_candsxE, even_candsxN=even_candsxN)
  share = lev.share
  if levelled_out is not None:
    levelled_out.append(lev)
  if load_stepsxE is not None:
    peak = mean_peak(grid, share, load_stepsxE)
  elif lev.peak_cands is not None:
    peak = lev.peak_cands
  else:
    peak = device_load(grid, share, load_E).max(1)
  if not sent_too:
    return grid, share, peak, None
  return grid, share, peak, estimate(grid, share, dev_NxE, load_E, total_N=total_N)[1].max(1)


def _per_source(grid, share, dev_NxE, load_E, cap_N, coarse_E, o: FsepOptions):
  """(shares of the rest, kept fractions) [N, rounds] of the chosen layout (module doc of
  moejax.placement.locality), in whole router parts when o.exact_parts."""
  kept, remote, rest = keep_local(grid[None], share[None], dev_NxE, load_E, cap_N,
                                  coarse_E[None])
  kept = local_parts(kept) if o.exact_parts else kept
  if o.exact_parts:
    base = np.einsum("knr,knr->kn", kept, own_counts(grid[None], dev_NxE))
    remote = quantise(grid[None], remote, rest[0], o.quantise_groups, base)
  return remote[0], kept[0]
