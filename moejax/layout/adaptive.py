"""Adaptive token shares: a held fsep layout's split re-levelled from each step's own counts.

The layout (which device holds a replica of which expert) is a planned, held decision: the
weights move with it. How an expert's tokens split over its replicas need not be held. Each
step, from the group's per-expert counts and each replica's own count (its hosting device's
choices of that expert), `shares` starts from parts in proportion to the own counts (plus
one), so that quotas sit where the tokens already are, and levels device loads in
LEVEL_ROUNDS multiplicative rounds (`level_parts`); the planned parts are kept where they
level the step better. Each device then keeps min(own, quota) of its own tokens on its own
replica, under the dense dispatch only as far as its own pair stays within the buffer the
program sizes at factor 1 (`keep_own`: keeping everything piles a hot expert's rows onto one
pair, decision 0097), and every source's remaining tokens fill the quotas left, split in
proportion to each replica's room (`remote_parts`). Device loads are the quotas whichever
sources fill them.

Each rule is written once over an array namespace `xp` (numpy here and in replay, jax.numpy in
`moejax.model.moe.replicas.adaptive_slots`) in int32 arithmetic and one float32 ratio per
device, so host and device compute the same integers bit for bit (below 2^26 rows per expert).
"""

from __future__ import annotations

import jax
import numpy as np

from moejax.layout import capacity
from moejax.layout.host_layout import SHARE_PARTS, Placement, share_parts

LEVEL_ROUNDS = 8
RATIO_RANGE = (0.25, 4.0)   # a device's slack ratio is clipped to this before squaring
BUDGET_ROUNDS = 3           # fixed-point steps of `keep_own` (the remote parts move with it)
WEIGHT_SCALE = 32           # weights = parts x ratio^2 x 32 <= 2^19: exact in int32 and float32


def scaled_floor(parts, count, phase=0):
  """floor((parts * count + phase) / SHARE_PARTS) without int32 overflow of parts * count."""
  q, r = count // SHARE_PARTS, count % SHARE_PARTS
  return parts * q + (parts * r + phase) // SHARE_PARTS


def quotas(xp, parts_ExR, counts_E):
  """Rows each replica serves of its expert's count: floor(P_r c / 1024) - floor(P_{r-1} c /
  1024) over the cumulative parts P (the planner's `placement.quotas`, per replica)."""
  hi_ExR = scaled_floor(xp.cumsum(parts_ExR, axis=1), counts_E[:, None])
  return hi_ExR - xp.pad(hi_ExR, ((0, 0), (1, 0)))[:, :-1]


def _segment_sum(xp, values, ids, size):
  if xp is np:
    out = np.zeros(size, values.dtype)
    np.add.at(out, ids.ravel(), values.ravel())
    return out
  return xp.zeros((size,), values.dtype).at[ids.ravel()].add(values.ravel())


def _proportional(xp, num_ExR, den_E, valid_ExR, fallback_ExR):
  """Integer parts of SHARE_PARTS in proportion to num_ExR per expert (den_E = their sum):
  floor, then one more part to the largest remainders (ties: lower replica). Experts with
  den 0 take `fallback_ExR`. int32-safe for den < 2^26 (num * 1024 in two steps)."""
  den = xp.maximum(den_E, 1)[:, None]
  a = num_ExR * 32
  b = (a % den) * 32
  parts = (a // den) * 32 + b // den
  rem = b % den
  short = SHARE_PARTS - xp.sum(parts, axis=1, keepdims=True)
  key = xp.where(valid_ExR, -rem, 1)                 # padding sorts last
  order = (np.argsort(key, axis=1, kind="stable") if xp is np
           else xp.argsort(key, axis=1, stable=True))
  rank = xp.argsort(order, axis=1)
  parts = parts + (valid_ExR & (rank < short)).astype(parts.dtype)
  return xp.where(den_E[:, None] > 0, parts, fallback_ExR)


def level_parts(xp, slots_ExR, parts_ExR, counts_E, num_devices: int, slots_per_device: int,
                rounds: int = LEVEL_ROUNDS):
  """int32 parts [E, R] (each expert's sum SHARE_PARTS) for the replica slots slots_ExR
  (-1 padded) that level device loads on this step's counts_E: `rounds` multiplicative rounds
  from parts_ExR, each weighting a replica by its device's slack ratio (mean / load, clipped)
  squared; a round that does not lower the busiest device is undone and the next one starts
  from the best parts with the plain ratio (over-relaxation overshoots where every expert
  sees the same ratios). The best parts are returned (the planned ones unless a round beats
  them). Fixed shapes and a fixed round count: the same program in jnp."""
  valid = slots_ExR >= 0
  dev = xp.where(valid, slots_ExR // slots_per_device, 0)
  mean = (xp.sum(counts_E) // num_devices).astype(xp.float32)

  def peak_and_ratio(parts):
    load_N = _segment_sum(xp, quotas(xp, parts, counts_E), dev, num_devices)
    ratio_N = xp.clip(mean / xp.maximum(load_N, 1).astype(xp.float32),
                      *RATIO_RANGE).astype(xp.float32)
    return xp.max(load_N), ratio_N

  def one_round(_, carry):
    best, best_peak, best_ratio, relax = carry
    gain_N = xp.where(relax, best_ratio * best_ratio, best_ratio)
    w = xp.floor(best.astype(xp.float32) * gain_N[dev] * xp.float32(WEIGHT_SCALE))
    w = xp.where(valid, w.astype(parts_ExR.dtype), 0)
    cur = _proportional(xp, w, xp.sum(w, axis=1), valid, best)
    peak, ratio_N = peak_and_ratio(cur)
    better = peak < best_peak
    return (xp.where(better, cur, best), xp.where(better, peak, best_peak),
            xp.where(better, ratio_N, best_ratio), relax & better)

  peak, ratio_N = peak_and_ratio(parts_ExR)
  carry = (parts_ExR, peak, ratio_N, peak >= 0)      # True, typed like the rounds' flags
  if xp is np:
    for i in range(rounds):
      carry = one_round(i, carry)
  else:          # a rolled loop: one round's program, not `rounds` copies of it
    carry = jax.lax.fori_loop(0, rounds, one_round, carry)
  return carry[0]


def keep_own(xp, own_ExR, quota_ExR, parts_ExR, valid_ExR, dev_ExR, num_devices: int,
             slots_per_device: int, cap: int | None, pooled: bool = False,
             rounds: int = BUDGET_ROUNDS):
  """Rows a device keeps on its own replica: all it has up to the replica's quota, and, with
  a capacity `cap` (the per-(source, slot) buffer at factor 1; None: no buffer), only as much
  as keeps its own pair within the buffer the program sizes anyway: the larger of the pair's
  rows when nothing is kept (own x levelled part) and the balanced share (`cap` per slot,
  C x `cap` per device when `pooled`). A kept row still fills the (source, own slot) pair,
  and so do the source's remaining rows split by the remote parts, which move with what
  every device keeps: `rounds` fixed-point steps from keeping all, the fixed point the
  planner's `moejax.placement.fsep.locality` also solves (with its own round count)."""
  keep0 = xp.where(valid_ExR, xp.minimum(own_ExR, quota_ExR), 0)
  if cap is None:
    return keep0
  nokeep = xp.where(valid_ExR, scaled_floor(parts_ExR, own_ExR), 0)
  if pooled:
    budget_N = xp.maximum(_segment_sum(xp, nokeep, dev_ExR, num_devices),
                          cap * slots_per_device)
    sum0_N = xp.maximum(_segment_sum(xp, keep0, dev_ExR, num_devices), 1)
  else:
    budget = xp.maximum(nokeep, cap)
  kept = keep0
  for _ in range(rounds):      # a few [E, R] steps: unrolled in jnp
    rp = remote_parts(xp, quota_ExR, kept, valid_ExR, parts_ExR)
    fixed = xp.where(valid_ExR, scaled_floor(rp, own_ExR), 0)    # own rows sent home anyway
    if pooled:
      room_N = xp.maximum(budget_N - _segment_sum(xp, fixed, dev_ExR, num_devices), 0)
      ratio_N = xp.minimum(room_N.astype(xp.float32) / sum0_N.astype(xp.float32), 1)
      kept = xp.floor(keep0.astype(xp.float32) * ratio_N[dev_ExR]).astype(keep0.dtype)
    else:
      kept = xp.clip(budget - fixed, 0, keep0)
  return xp.minimum(kept, keep0)


def remote_parts(xp, quota_ExR, kept_ExR, valid_ExR, parts_ExR):
  """Parts by which every source splits what it did not keep: each replica's room, quota -
  kept, over the expert's total room (the levelled parts where nothing is left)."""
  room = xp.where(valid_ExR, quota_ExR - kept_ExR, 0)
  return _proportional(xp, room, xp.sum(room, axis=1), valid_ExR, parts_ExR)


def replica_tables(p: Placement, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
  """(slots [E, N], parts [E, N]) int32, as a Layout row holds them (-1 / 0 padded)."""
  n = p.num_devices
  slots = np.full((num_experts, n), -1, np.int32)
  parts = np.zeros((num_experts, n), np.int32)
  all_parts = share_parts(p, num_experts)
  for e in range(num_experts):
    mine = np.flatnonzero(p.slot_expert == e)
    slots[e, :len(mine)] = mine
    parts[e, :len(mine)] = all_parts[mine]
  return slots, parts


def device_peak(xp, parts_ExR, counts_E, dev_ExR, num_devices: int):
  """The busiest device's rows when each replica serves its quota."""
  return xp.max(_segment_sum(xp, quotas(xp, parts_ExR, counts_E), dev_ExR, num_devices))


def shares(xp, slots_ExR, planned_ExR, counts_E, own_ExR, num_devices: int,
           slots_per_device: int, cap: int | None, rounds: int = LEVEL_ROUNDS,
           pooled: bool = False):
  """(quota, kept, remote parts), each [E, R], of one step: the rows each replica serves, the
  rows its own device keeps on it, and the parts by which every source splits the rest.
  counts_E: the group's counts; own_ExR: each replica's hosting device's count of its expert
  (0 on padding)."""
  valid = slots_ExR >= 0
  dev = xp.where(valid, slots_ExR // slots_per_device, 0)
  near = xp.where(valid, own_ExR + 1, 0)
  start = _proportional(xp, near, xp.sum(near, axis=1), valid, planned_ExR)
  parts = level_parts(xp, slots_ExR, start, counts_E, num_devices, slots_per_device, rounds)
  worse = (device_peak(xp, planned_ExR, counts_E, dev, num_devices) <
           device_peak(xp, parts, counts_E, dev, num_devices))
  parts = xp.where(worse, planned_ExR, parts)
  quota = quotas(xp, parts, counts_E)
  kept = keep_own(xp, own_ExR, quota, parts, valid, dev, num_devices, slots_per_device, cap,
                  pooled)
  return quota, kept, remote_parts(xp, quota, kept, valid, parts)


def balanced_cap(counts_NxE: np.ndarray, p: Placement) -> int:
  """The rows a device may keep on each own replica: the dense dispatch's per-(source, slot)
  buffer at capacity factor 1, T * K / (N * C) of the busiest source, which the program sizes
  at any factor >= 1."""
  per_source = int(np.asarray(counts_NxE).sum(1).max())
  return capacity.rows("slot", per_source, 1, p.num_devices, p.slots_per_device, 1.0)


def split_adaptive(p: Placement, counts_NxE: np.ndarray, cap: int | None = None,
                   rounds: int = LEVEL_ROUNDS, pooled: bool = False) -> np.ndarray:
  """Rows each device (one source per device, as in the layer) sends to each slot, int64
  [N, S], under adaptive shares: the layer's rule (`replicas.adaptive_slots`) on the host."""
  counts_NxE = np.asarray(counts_NxE).astype(np.int32)
  n, num_experts = counts_NxE.shape
  c = p.slots_per_device
  slots, planned = replica_tables(p, num_experts)
  valid = slots >= 0
  counts_E = counts_NxE.sum(0).astype(np.int32)
  dev = np.where(valid, slots // c, 0)
  own = np.where(valid, counts_NxE[dev, np.arange(num_experts)[:, None]], 0)
  _, kept, remote = shares(np, slots, planned, counts_E, own, n, c, cap, rounds, pooled)
  kept_NxE = np.zeros((n, num_experts), np.int32)
  np.add.at(kept_NxE, (dev[valid], np.nonzero(valid)[0]), kept[valid])
  phase_N = np.arange(n, dtype=np.int32) * SHARE_PARTS // n
  hi = scaled_floor(np.cumsum(remote, axis=1)[None], (counts_NxE - kept_NxE)[:, :, None],
                    phase_N[:, None, None])
  rows_NxExR = np.diff(hi, axis=2, prepend=0)
  out = np.zeros((n, len(p.slot_expert)), np.int64)
  e_idx, r_idx = np.nonzero(valid)
  for d in range(n):
    np.add.at(out[d], slots[e_idx, r_idx], rows_NxExR[d, e_idx, r_idx])
  np.add.at(out, (dev[valid], slots[valid]), kept[valid])
  return out
