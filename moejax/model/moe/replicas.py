"""Choose a replica slot for every (token, k) choice, inside shard_map (fsep layouts).

`split_slots` first keeps the planned local parts of each source's choices of an expert on
its own device's replica (per-source shares), then splits the rest over the expert's replicas
by the planned shares, so every (source, slot) pair carries about share x count and the dense
dispatch's fixed per-pair capacity suffices. The device-side twin of the host's "split" rule
(`moejax.layout.host_layout.split_loads`). `adaptive_slots` (`moe.fsep_shares = 'adaptive'`)
keeps the layout but levels the shares on the step's own counts first: the device-side twin
of `moejax.layout.adaptive.split_adaptive`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.layout import adaptive
from moejax.layout.adaptive import scaled_floor


def rank_within_expert(expert_TK: jax.Array, num_experts: int) -> jax.Array:
  """For each choice, how many earlier choices on this device picked the same expert."""
  n = expert_TK.shape[0]
  order = jnp.argsort(expert_TK, stable=True)
  counts = jnp.zeros((num_experts,), jnp.int32).at[expert_TK].add(1)
  starts = jnp.cumsum(counts) - counts
  ranks_sorted = jnp.arange(n, dtype=jnp.int32) - starts[expert_TK[order]]
  return jnp.zeros((n,), jnp.int32).at[order].set(ranks_sorted)


def local_replicas(expert_slots_ExR: jax.Array, slot_local_parts_S: jax.Array,
                   device: jax.Array, slots_per_device: int) -> tuple[jax.Array, jax.Array]:
  """(kept parts [E], local slot [E]) of this device: for each expert, its replica on this
  device (a layout holds at most one per device) and the parts of this device's choices that
  replica keeps; 0 and -1 where the device holds none."""
  mine_ExR = (expert_slots_ExR >= 0) & (expert_slots_ExR // slots_per_device == device)
  safe_ExR = jnp.maximum(expert_slots_ExR, 0)
  kept_E = jnp.sum(jnp.where(mine_ExR, slot_local_parts_S[safe_ExR], 0), axis=1)
  slot_E = jnp.max(jnp.where(mine_ExR, expert_slots_ExR, -1), axis=1)
  return kept_E, slot_E


def _counts(expert_TK: jax.Array, num_experts: int) -> jax.Array:
  return jnp.zeros((num_experts,), jnp.int32).at[expert_TK].add(1)


def _split(expert_TK, expert_slots_ExR, expert_parts_ExR, phase, kept_E, local_slot_E):
  """The first kept_E[e] choices of e (token order) to local_slot_E[e], the rest by the
  cumulative parts with `phase` (see split_slots); kept_E None keeps nothing."""
  num_experts = expert_slots_ExR.shape[0]
  counts_E = _counts(expert_TK, num_experts)
  rank_TK = rank_within_expert(expert_TK, num_experts)
  cum_ExR = jnp.cumsum(expert_parts_ExR, axis=1)
  bounds_ExR = scaled_floor(cum_ExR, (counts_E - (0 if kept_E is None else kept_E))[:, None],
                            phase)
  rest_TK = rank_TK - (0 if kept_E is None else kept_E[expert_TK])
  r_TK = jnp.sum(bounds_ExR[expert_TK] <= rest_TK[:, None], axis=1)
  r_TK = jnp.minimum(r_TK, jnp.sum(expert_slots_ExR >= 0, axis=1)[expert_TK] - 1)
  slot_TK = jnp.take_along_axis(expert_slots_ExR[expert_TK], r_TK[:, None], axis=1)[:, 0]
  if kept_E is None:
    return slot_TK
  return jnp.where(rest_TK < 0, local_slot_E[expert_TK], slot_TK)


def split_slots(expert_TK: jax.Array, expert_slots_ExR: jax.Array,
                expert_parts_ExR: jax.Array, phase: jax.Array,
                kept_parts_E: jax.Array | None = None,
                local_slot_E: jax.Array | None = None) -> jax.Array:
  """Local parts, then a proportional split (what the dense dispatch uses): of this
  device's c_e choices of expert e, in token order, the first k_e = floor(kept_e c_e / 1024)
  go to its local replica (`local_replicas`; none without `kept_parts_E`), the other
  c' = c_e - k_e to e's replicas in slot order, replica r taking
  floor((P_r c' + phase) / 1024) - floor((P_{r-1} c' + phase) / 1024); `phase` = source
  index * 1024 // sources spreads the rounding over replicas. Every (source, slot) pair then
  carries ~ share x count, so fixed per-pair capacity suffices. Same rule as
  `moejax.layout.host_layout.split_loads`."""
  kept_E = None
  if kept_parts_E is not None:
    kept_E = scaled_floor(kept_parts_E, _counts(expert_TK, expert_slots_ExR.shape[0]))
  return _split(expert_TK, expert_slots_ExR, expert_parts_ExR, phase, kept_E, local_slot_E)


def adaptive_slots(expert_TK: jax.Array, expert_slots_ExR: jax.Array,
                   expert_parts_ExR: jax.Array, axis: str, slots_per_device: int,
                   cap: int | None, pooled: bool = False) -> jax.Array:
  """Adaptive shares (`moejax.layout.adaptive`) for this device's choices expert_TK, inside
  shard_map over `axis` (the expert axis: the devices that exchange tokens). One psum of the
  int32 [E] counts and one all_gather of the [C] counts of the experts this device hosts give
  every device the group's counts and each replica's own count, from which each computes the
  same kept rows and remote parts (`adaptive.shares`). No gradient flows through these integer
  choices: every replica holds the same restored weights, so which one computes a row
  changes no value."""
  device = jax.lax.axis_index(axis)
  num_devices = jax.lax.axis_size(axis)
  num_experts = expert_slots_ExR.shape[0]
  counts_E = _counts(expert_TK, num_experts)
  total_E = jax.lax.psum(counts_E, axis)
  valid = expert_slots_ExR >= 0
  mine = valid & (expert_slots_ExR // slots_per_device == device)
  local_C = jnp.where(mine, expert_slots_ExR - device * slots_per_device, slots_per_device)
  own_C = jnp.zeros((slots_per_device,), jnp.int32).at[local_C.ravel()].add(
      jnp.where(mine, counts_E[:, None], 0).ravel(), mode="drop")
  own_S = jax.lax.all_gather(own_C, axis, tiled=True)
  own_ExR = jnp.where(valid, own_S[jnp.maximum(expert_slots_ExR, 0)], 0)
  _, kept_ExR, remote = adaptive.shares(jnp, expert_slots_ExR, expert_parts_ExR, total_E,
                                        own_ExR, num_devices, slots_per_device, cap,
                                        pooled=pooled)
  phase = device * adaptive.SHARE_PARTS // num_devices
  kept_E = jnp.sum(jnp.where(mine, kept_ExR, 0), axis=1)
  local_slot_E = jnp.max(jnp.where(mine, expert_slots_ExR, -1), axis=1)
  return _split(expert_TK, expert_slots_ExR, remote, phase, kept_E, local_slot_E)
