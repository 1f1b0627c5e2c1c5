"""The fsep planner: one MoE layer's replicas, their devices and token shares (numpy only).

  place_replicas(pred_WxE, current, *, slots, src_dev_W, cost, num_devices, options)

Every slot hosts an expert (all N*C of them when C <= E), at most one replica of an expert
per device. Each candidate replica count (`counts`) is dealt to devices round by round
(`deal`), its shares levelled towards equal device loads (`shares.levelled`) and scored by
the cost model on the busiest device and the rows sent (`score`), on the window's steps
with plan_for='spread' (`spread`); under the dense dispatch near ties go to the candidate
that overflows its buffers least. A bound from the deal order alone prunes candidates
without changing the choice. The chosen shares are rounded to the router's parts
(`shares.quantise`); then each device keeps its own tokens on its own replicas first, within
the buffer the program sizes anyway (`locality`). Decisions 0012, 0022, 0023, 0049, 0056,
0060 and 0061 give the reasons and the numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from moejax.config import ConfigError
from moejax.layout.host_layout import Placement
from moejax.placement.fsep.counts import replica_counts, snap_counts
from moejax.placement.fsep.deal import deal, deal_bound
from moejax.placement.fsep.locality import keep_local, local_parts
from moejax.placement.fsep.score import (
  column_sums,
  device_load,
  estimate,
  fold_sources,
  overflow,
  own_counts,
)
from moejax.placement.fsep.shares import levelled, quantise
from moejax.placement.fsep.spread import (
  hedge_loads,
  mean_peak,
  recent_center,
  step_totals,
  window_loads,
)
from moejax.placement.layer_cost import CostModel

TIME_SLACK = 0.01     # relative score within which the dense dispatch's overflow decides
DEFAULT_CANDIDATES = ("even", "dhondt")
PLAN_FOR = ("spread", "mean")
CENTERS = ("median", "mean")
CAPACITY_MODES = ("slot", "device")
NO_COST = ("the fsep planner got cost=None; pass the run's cost model, "
           "moejax.strategy.placement_cost.placement_cost(cfg.model, cfg.moe, profile).")


@dataclasses.dataclass(frozen=True)
class FsepOptions:
  candidates: tuple[str, ...] = DEFAULT_CANDIDATES   # replica-count rules tried (CANDIDATES)
  level_iters: int = 3                 # Sinkhorn steps levelling the shares
  exact_parts: bool = True             # snap and round shares to the router's parts
  quantise_groups: int = 1             # expert batches in `quantise`
  min_parts: int = 16                  # `snap_counts`: parts per replica below which ...
  max_part: float = 0.02               # ... or one part above this share of a device: coarse
  capacity_factor: float | None = None  # the dense dispatch's (None: dropless, time decides)
  capacity: str = "slot"               # its buffers: per (source, slot) or "device" (pooled)
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
  plans for (moejax.placement.fsep.spread); without two or more it plans for the mean."""
  o = options
  if o.plan_for not in PLAN_FOR:
    raise ConfigError(f"fsep plan_for={o.plan_for!r} is unknown; choose one of {PLAN_FOR}.")
  if o.capacity not in CAPACITY_MODES:
    raise ConfigError(f"fsep capacity={o.capacity!r} is unknown; choose one of "
                      f"{CAPACITY_MODES} (moe.capacity).")
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
  if cost is None:
    raise ConfigError(NO_COST)
  spread = (o.plan_for == "spread" and samples_stepsxWxE is not None and len(samples_stepsxWxE) > 1)
  totals_stepsxE = step_totals(samples_stepsxWxE) if spread else None
  if spread and o.center == "median":
    pred = recent_center(pred, totals_stepsxE, o.center_steps)
  dev_NxE = fold_sources(pred, src_dev_W, n)
  load_E = column_sums(dev_NxE)
  rounds = min(c, num_experts)              # more than E slots: every device holds all E
  total = n * rounds
  load_stepsxE = window_loads(totals_stepsxE, load_E.sum()) if spread else None
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
  # One buffer size for every source: the program sizes it from T x K, the same everywhere
  # (the predicted counts' row sums differ only where spread planning rescaled experts).
  buffers = n if o.capacity == "device" else n * c       # per source
  cap_N = (None if o.capacity_factor is None else
           np.full(n, o.capacity_factor * float(total_N.mean()) / buffers))
  peak_of = functools.partial(peaks, load_E=load_E, load_stepsxE=load_stepsxE, dev_NxE=dev_NxE,
                              total_N=total_N, n=n, rounds=rounds, iters=o.level_iters)
  # The candidate with the lowest bound on its score first; the others only where their
  # bound does not already rule them out, before they are placed (at N = 4096 'even' snaps
  # every expert to even shares, and its bound, 1.6x the mean load, rules it out). Bounds
  # are checked against the score before it is tie-broken, so pruning changes no choice.
  peak_lo, sent_lo = deal_bound(r_candsxE, coarse_candsxE, load_E, load_stepsxE, dev_NxE,
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
  close = np.flatnonzero(np.asarray(step_s) <= min(step_s) * (1 + TIME_SLACK))
  if o.capacity_factor is not None and len(close) > 1:   # near ties: the buffers decide
    dropped = overflow(grid[close], share[close], dev_NxE, cap_N, pooled=o.capacity == "device")
    best = int(close[min(range(len(close)), key=lambda i: (dropped[i], step_s[close[i]]))])
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
    share, local = _per_source(grid, share, dev_NxE, load_E, c, plain_E, o)  # keep the split
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


def peaks(r_candsxE, coarse_candsxE, *, load_E, load_stepsxE, dev_NxE, total_N, n, rounds, iters,
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


def _per_source(grid, share, dev_NxE, load_E, slots, coarse_E, o: FsepOptions):
  """(shares of the rest, kept fractions) [N, rounds] of the chosen layout (module doc of
  moejax.placement.fsep.locality), in whole router parts when o.exact_parts. Under the dense
  dispatch what is kept stays within the buffer the program sizes anyway."""
  mode = None if o.capacity_factor is None else o.capacity
  kept, remote, rest = keep_local(grid[None], share[None], dev_NxE, load_E, coarse_E[None],
                                  capacity=mode, slots=slots)
  kept = local_parts(kept) if o.exact_parts else kept
  if o.exact_parts:
    base = np.einsum("knr,knr->kn", kept, own_counts(grid[None], dev_NxE))
    remote = quantise(grid[None], remote, rest[0], o.quantise_groups, base)
  return remote[0], kept[0]
