"""Placements (host-side layouts) and how tokens flow under them (numpy only).

A `Placement` describes one MoE layer on N devices with C slots each: which expert each slot
hosts (-1 = empty) and the share of that expert's tokens the slot is planned to serve, with
one of three token rules ("local_first", "split", "adaptive"; `Placement` says each).
Planners return Placements; replay evaluates them; the trainer turns them into JAX `Layout`s.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Placement:
  """One layer's slots and shares; `routing` is the token rule:
  - "local_first" (shadow experts): a source device's tokens for expert e go to a
    replica of e on the same device while that replica's quota (share x the
    expert's actual tokens) lasts; the rest fill the remaining quotas in slot order.
  - "split" (fsep training, the dense dispatch): a source on device d first keeps
    floor(lambda c / 1024) of its c tokens for e on d's own replica of e, lambda being that
    slot's `local` parts (per-source shares: the planner sets them so that devices stay
    level and fewer rows leave their source; zero keeps nothing back). It splits the other
    c' tokens over e's replicas by the shares, so every (source, slot) pair carries ~ share x
    count: with cumulative parts P_r, replica r gets floor((P_r c' + phase) / 1024) -
    floor((P_{r-1} c' + phase) / 1024), where a source on device d of N uses phase
    d * 1024 // N, so rounding leftovers do not all land on the same replica.
  - "adaptive" (fsep with `moe.fsep_shares = 'adaptive'`): the held layout with its shares
    re-levelled from each step's own counts (`moejax.layout.adaptive`; routed by `flow`).
  """
  slot_expert: np.ndarray    # int32 [N*C]; -1 = empty slot
  share: np.ndarray          # float64 [N*C]; per expert, shares of its slots sum to 1
  num_devices: int
  routing: str = "local_first"   # or "split" or "adaptive" (see above)
  # float [N*C] or None: "split" only, the share of its own device's tokens for the slot's
  # expert that a slot keeps before the rest is split by `share` (None: nothing kept back).
  local: np.ndarray | None = None

  @property
  def slots_per_device(self) -> int:
    return len(self.slot_expert) // self.num_devices

  @property
  def device_of_slot(self) -> np.ndarray:
    return np.arange(len(self.slot_expert)) // self.slots_per_device

  def replicas(self, num_experts: int) -> np.ndarray:
    """Copies of each expert, int [E]."""
    hosted = self.slot_expert[self.slot_expert >= 0]
    return np.bincount(hosted, minlength=num_experts)

  def is_one_copy(self, num_experts: int) -> bool:
    return bool(np.all(self.replicas(num_experts) == 1))

  def validate(self, num_experts: int) -> None:
    reps = self.replicas(num_experts)
    if np.any(reps == 0):
      missing = np.flatnonzero(reps == 0).tolist()
      raise ConfigError(f"placement hosts no copy of experts {missing}; every expert needs a slot.")
    sums = np.bincount(self.slot_expert[self.slot_expert >= 0],
                       weights=self.share[self.slot_expert >= 0], minlength=num_experts)
    if not np.allclose(sums, 1.0, atol=1e-6):
      raise ConfigError(f"placement shares per expert sum to {np.round(sums, 4).tolist()}, not 1.")
    if self.local is not None:
      lo, hi = float(np.min(self.local)), float(np.max(self.local))
      if len(self.local) != len(self.slot_expert) or lo < 0 or hi > 1:
        raise ConfigError(f"placement local shares must be {len(self.slot_expert)} values in "
                          f"[0, 1], got {len(self.local)} in [{lo}, {hi}].")


def one_copy(slot_expert: np.ndarray, num_devices: int) -> Placement:
  slot_expert = np.asarray(slot_expert, np.int32)
  return Placement(slot_expert, (slot_expert >= 0).astype(np.float64), num_devices)


def static(num_experts: int, num_devices: int) -> Placement:
  """Expert e on device e // (E/N)."""
  if num_experts % num_devices:
    raise ConfigError(f"static placement needs E={num_experts} divisible by N={num_devices}.")
  return one_copy(np.arange(num_experts, dtype=np.int32), num_devices)


def source_devices(num_sources: int, num_devices: int) -> np.ndarray:
  """Source w runs on device w*N // W. Needs W % N == 0 or N % W == 0 (even spread)."""
  if num_sources % num_devices and num_devices % num_sources:
    raise ConfigError(f"{num_sources} trace sources cannot spread evenly over {num_devices} "
                      f"devices; use a device count that divides {num_sources} or is a "
                      "multiple of it.")
  return np.arange(num_sources) * num_devices // num_sources


SHARE_PARTS = 1024   # token shares are integer parts of 1024 so host and device agree exactly


def share_parts(p: Placement, num_experts: int) -> np.ndarray:
  """int64 [N*C]: each slot's share in parts of SHARE_PARTS; per expert they sum exactly to
  SHARE_PARTS (floor, then the remainder to the largest fractional parts, lowest slot first)."""
  se = p.slot_expert
  hosted = se >= 0
  exact = np.where(hosted, p.share * SHARE_PARTS, 0.0)
  parts = np.floor(exact + 1e-9).astype(np.int64)
  short = np.full(num_experts, SHARE_PARTS, np.int64)
  np.subtract.at(short, se[hosted], parts[hosted])
  frac = np.where(hosted, exact - parts, -1.0)
  for e in np.flatnonzero(short > 0):
    slots = np.flatnonzero(se == e)
    order = slots[np.argsort(-frac[slots], kind="stable")]
    parts[order[: short[e]]] += 1
  return parts


def local_parts(p: Placement) -> np.ndarray:
  """int64 [N*C]: each slot's kept-back share of its own device's tokens, in parts of
  SHARE_PARTS (floor; zeros without `local` or for empty slots)."""
  if p.local is None:
    return np.zeros(len(p.slot_expert), np.int64)
  parts = np.floor(np.asarray(p.local, np.float64) * SHARE_PARTS + 1e-9).astype(np.int64)
  return np.where(p.slot_expert >= 0, np.clip(parts, 0, SHARE_PARTS), 0)


def local_slots(p: Placement, num_experts: int) -> np.ndarray:
  """int64 [N, E]: the slot of device d that hosts expert e, or -1 (at most one per device)."""
  out = np.full((p.num_devices, num_experts), -1, np.int64)
  hosted = np.flatnonzero(p.slot_expert >= 0)
  out[p.device_of_slot[hosted], p.slot_expert[hosted]] = hosted
  return out


def quotas(placement: Placement, totals_E: np.ndarray) -> np.ndarray:
  """Integer tokens per slot, exact: with an expert's replicas in slot order and cumulative
  parts P_r, replica r serves floor(P_r * T / 1024) - floor(P_{r-1} * T / 1024) of its T."""
  se = placement.slot_expert
  parts = share_parts(placement, len(totals_E))
  q = np.zeros(len(se), np.int64)
  for e in np.unique(se[se >= 0]):
    slots = np.flatnonzero(se == e)
    cum = np.cumsum(parts[slots])
    hi = cum * int(totals_E[e]) // SHARE_PARTS
    q[slots] = np.diff(np.concatenate([[0], hi]))
  return q


def split_loads(placement: Placement, counts_WxE: np.ndarray,
                src_dev_W: np.ndarray | None = None) -> np.ndarray:
  """"split" rule: (token, k) rows each source sends to each slot, int64 [W, S]: first the
  local parts of its own device's replica, the rest by the shares. A source on device d uses
  phase d * 1024 // N, as on the device (default: source s on device s)."""
  counts_WxE = np.asarray(counts_WxE, np.int64)
  num_sources, num_experts = counts_WxE.shape
  se = placement.slot_expert
  parts = share_parts(placement, num_experts)
  out = np.zeros((num_sources, len(se)), np.int64)
  src = np.arange(num_sources) if src_dev_W is None else np.asarray(src_dev_W)
  phase_W = src * SHARE_PARTS // placement.num_devices
  rest_WxE = counts_WxE
  if placement.local is not None:
    slot_WxE = local_slots(placement, num_experts)[src]
    lp_WxE = np.where(slot_WxE >= 0, local_parts(placement)[np.maximum(slot_WxE, 0)], 0)
    kept_WxE = lp_WxE * counts_WxE // SHARE_PARTS
    rows, cols = np.nonzero(slot_WxE >= 0)
    out[rows, slot_WxE[rows, cols]] = kept_WxE[rows, cols]    # one slot per (source, expert)
    rest_WxE = counts_WxE - kept_WxE
  for e in np.unique(se[se >= 0]):
    slots = np.flatnonzero(se == e)
    cum_parts = np.cumsum(parts[slots])[None, :]
    hi = (cum_parts * rest_WxE[:, e:e + 1] + phase_W[:, None]) // SHARE_PARTS
    out[:, slots] += np.diff(hi, axis=1, prepend=0)
  return out


def route(placement: Placement, counts_WxE: np.ndarray, src_dev_W: np.ndarray):
  """Routes by `placement.routing`. Returns (slot_load [N*C], tokens_WxN sent by source to
  device)."""
  counts_WxE = np.asarray(counts_WxE, np.int64)
  num_sources, num_experts = counts_WxE.shape
  se, dev = placement.slot_expert, placement.device_of_slot
  n = placement.num_devices
  if placement.routing == "adaptive":
    raise ConfigError("placement.route cannot apply adaptive shares: they need the per-device "
                      "counts; route it with moejax.layout.flow.flow.")
  sent_WxN = np.zeros((num_sources, n), np.int64)
  if placement.routing == "split":
    loads_WxS = split_loads(placement, counts_WxE, src_dev_W)
    np.add.at(sent_WxN.T, dev, loads_WxS.T)
    return loads_WxS.sum(0), sent_WxN
  if placement.is_one_copy(num_experts):
    slot_of_e = np.empty(num_experts, np.int64)
    slot_of_e[se[se >= 0]] = np.flatnonzero(se >= 0)
    slot_load = np.zeros(len(se), np.int64)
    slot_load[slot_of_e] = counts_WxE.sum(0)
    np.add.at(sent_WxN.T, dev[slot_of_e], counts_WxE.T)
    return slot_load, sent_WxN
  if one_per_device(placement, num_experts):
    return _route_one_per_device(placement, counts_WxE, src_dev_W)
  return route_local_first_loop(placement, counts_WxE, src_dev_W)


def route_local_first_loop(placement: Placement, counts_WxE: np.ndarray,
                           src_dev_W: np.ndarray):
  """The plain-loop statement of local-first routing: the spec the vectorised paths of
  `route` are tested against, and the fallback when a device holds two replicas of one
  expert."""
  counts_WxE = np.asarray(counts_WxE, np.int64)
  num_sources, num_experts = counts_WxE.shape
  se, dev = placement.slot_expert, placement.device_of_slot
  sent_WxN = np.zeros((num_sources, placement.num_devices), np.int64)
  q = quotas(placement, counts_WxE.sum(0))
  left = q.copy()
  for e in range(num_experts):
    slots = np.flatnonzero(se == e)
    rest = counts_WxE[:, e].copy()
    for s in np.flatnonzero(rest):                    # local replicas first
      for r in slots[dev[slots] == src_dev_W[s]]:
        take = min(rest[s], left[r])
        left[r] -= take
        rest[s] -= take
        sent_WxN[s, dev[r]] += take
    for s in np.flatnonzero(rest):                    # then any replica, in slot order
      for r in slots:
        take = min(rest[s], left[r])
        left[r] -= take
        rest[s] -= take
        sent_WxN[s, dev[r]] += take
  return q - left, sent_WxN


def presence(p: Placement, num_experts: int) -> np.ndarray:
  """bool [N, E]: device d holds a copy of expert e."""
  out = np.zeros((p.num_devices, num_experts), bool)
  hosted = p.slot_expert >= 0
  out[p.device_of_slot[hosted], p.slot_expert[hosted]] = True
  return out


def one_per_device(placement: Placement, num_experts: int) -> bool:
  """True if no device holds two replicas of one expert."""
  se = placement.slot_expert
  hosted = se >= 0
  keys = placement.device_of_slot[hosted].astype(np.int64) * num_experts + se[hosted]
  return len(np.unique(keys)) == len(keys)


def _quotas_vec(placement: Placement, totals_E: np.ndarray) -> np.ndarray:
  """`quotas` without per-expert loops (same integers): share_parts' remainder parts go, per
  expert, to the slots ranked first by (fractional part desc, slot asc); the cumulative parts
  are then taken per expert in slot order."""
  se = placement.slot_expert
  num_experts = len(totals_E)
  hosted = np.flatnonzero(se >= 0)
  e_h = se[hosted].astype(np.int64)
  exact = placement.share[hosted] * SHARE_PARTS
  parts = np.floor(exact + 1e-9).astype(np.int64)
  short = SHARE_PARTS - np.bincount(e_h, weights=parts, minlength=num_experts).astype(np.int64)
  by_frac = np.lexsort((hosted, -(exact - parts), e_h))     # per expert: frac desc, slot asc
  starts = np.searchsorted(e_h[by_frac], e_h[by_frac])
  rank = np.arange(len(hosted)) - starts
  parts[by_frac] += rank < short[e_h[by_frac]]
  by_slot = np.argsort(e_h, kind="stable")                  # per expert: slot order
  e_s = e_h[by_slot]
  cum = np.cumsum(parts[by_slot])
  first = np.searchsorted(e_s, e_s)
  cum = cum - (cum[first] - parts[by_slot][first])          # cumulative within the expert
  hi = cum * np.asarray(totals_E).astype(np.int64)[e_s] // SHARE_PARTS
  lo = np.where(np.arange(len(hi)) == first, 0, np.concatenate([[0], hi[:-1]]))
  q = np.zeros(len(se), np.int64)
  q[hosted[by_slot]] = hi - lo
  return q


def _route_one_per_device(placement: Placement, counts_WxE: np.ndarray, src_dev_W: np.ndarray):
  """`route` without loops for placements with at most one replica per (device, expert).

  Local phase, elementwise: sources on one device take from its replica of e in source order,
  so source s takes min(count, max(0, quota - counts of earlier sources on its device)).
  Remote phase: per expert, the sources' remaining tokens (source order) and the replicas' left
  quotas (slot order) are two partitions of the same length; the greedy fill sends to replica r
  from source s exactly the overlap of their intervals. All experts are laid end to end on one
  line and the overlaps are the segments between the merged interval ends."""
  num_sources, num_experts = counts_WxE.shape
  se, dev, n = placement.slot_expert, placement.device_of_slot, placement.num_devices
  src = np.asarray(src_dev_W, np.int64)
  q = _quotas_vec(placement, counts_WxE.sum(0))
  hosted = np.flatnonzero(se >= 0)
  local_slot = np.full((n, num_experts), -1, np.int64)
  local_slot[dev[hosted], se[hosted]] = hosted
  slot_WxE = local_slot[src]                                  # [W, E] local replica or -1
  order = np.argsort(src, kind="stable")
  c_sorted = counts_WxE[order]
  before = np.cumsum(c_sorted, 0) - c_sorted                  # exclusive, over sorted sources
  first = np.searchsorted(src[order], src[order])             # first source of each device
  prefix = np.empty_like(counts_WxE)
  prefix[order] = before - before[first]
  has = slot_WxE >= 0
  q_WxE = np.where(has, q[np.maximum(slot_WxE, 0)], 0)
  take = np.minimum(counts_WxE, np.maximum(q_WxE - prefix, 0))
  sent_WxN = np.zeros((num_sources, n), np.int64)
  sent_WxN[np.arange(num_sources), src] = take.sum(1)
  used = np.bincount(slot_WxE[has], weights=take[has], minlength=len(se))
  used = np.rint(used).astype(np.int64)
  left = q - used
  rest = counts_WxE - take
  rest[:, np.bincount(se[hosted], minlength=num_experts) == 0] = 0   # unhosted: dropped
  src_end = np.cumsum(rest.T.ravel())                         # expert-major, source order
  reps = hosted[np.argsort(se[hosted], kind="stable")]        # expert-major, slot order
  rep_end = np.cumsum(left[reps])
  if len(src_end) and len(rep_end) and src_end[-1] > 0:
    ends = np.union1d(src_end, rep_end)
    starts = np.concatenate([[0], ends[:-1]])
    seg = ends - starts
    keep = seg > 0
    starts, seg = starts[keep], seg[keep]
    s_of = np.searchsorted(src_end, starts, side="right") % num_sources
    r_of = reps[np.searchsorted(rep_end, starts, side="right")]
    remote = np.bincount(s_of * n + dev[r_of], weights=seg, minlength=num_sources * n)
    sent_WxN += np.rint(remote).astype(np.int64).reshape(num_sources, n)
    used += np.rint(np.bincount(r_of, weights=seg, minlength=len(se))).astype(np.int64)
  return used, sent_WxN


def device_load(placement: Placement, slot_load: np.ndarray) -> np.ndarray:
  return slot_load.reshape(placement.num_devices, -1).sum(1)


def crossing(sent_WxN: np.ndarray, src_dev_W: np.ndarray) -> int:
  """Tokens whose expert runs on a device other than their source's."""
  local = sent_WxN[np.arange(len(src_dev_W)), src_dev_W].sum()
  return int(sent_WxN.sum() - local)


def device_counts(counts_WxE: np.ndarray, src_dev_W: np.ndarray, num_devices: int) -> np.ndarray:
  """Sum sources on the same device: [N, E]."""
  out = np.zeros((num_devices, counts_WxE.shape[1]), np.float64)
  np.add.at(out, src_dev_W, counts_WxE)
  return out
