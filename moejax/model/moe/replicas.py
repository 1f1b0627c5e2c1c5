"""Choose a replica slot for every (token, k) choice, inside shard_map (fsep layouts).

`split_slots` (used by the dense dispatch) splits each source's choices of an
expert over its replicas by the planned shares. `choose_slots` is the local-first
rule below; it keeps more tokens on their own device but concentrates a source's
tokens on its local slots, which fixed per-(source, slot) capacity cannot absorb,
so it awaits a dropless (ragged) dispatch.

Deterministic and identical on every device, from the all-gathered [sources x
experts] count matrix of this device's expert group (the same rule as
`moejax.planner.placement.route`):
  1. each replica r of expert e serves a quota of e's tokens: with cumulative share
     parts P_r (replicas in slot order), floor(P_r * T_e / 1024) - floor(P_{r-1} * T_e / 1024);
  2. a source's choices of e go first to the replica of e on its own device, up to
     that replica's quota (a device holds at most one replica of an expert);
  3. the rest take global positions (sources in order, then token order) and fill
     the remaining quotas in slot order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.layout.placement import SHARE_PARTS


def _scaled_floor(cum_parts, total):
  """floor(cum_parts * total / SHARE_PARTS) without int32 overflow."""
  q, r = total // SHARE_PARTS, total % SHARE_PARTS
  return cum_parts * q + (cum_parts * r) // SHARE_PARTS


def rank_within_expert(expert_A: jax.Array, num_experts: int) -> jax.Array:
  """For each choice, how many earlier choices on this device picked the same expert."""
  n = expert_A.shape[0]
  order = jnp.argsort(expert_A, stable=True)
  counts = jnp.zeros((num_experts,), jnp.int32).at[expert_A].add(1)
  starts = jnp.cumsum(counts) - counts
  ranks_sorted = jnp.arange(n, dtype=jnp.int32) - starts[expert_A[order]]
  return jnp.zeros((n,), jnp.int32).at[order].set(ranks_sorted)


def split_slots(expert_A: jax.Array, expert_slots_ExR: jax.Array,
                expert_parts_ExR: jax.Array, phase: jax.Array) -> jax.Array:
  """Proportional split (what the dense dispatch uses): this device's choices of expert e,
  in token order, go to e's replicas in slot order, replica r taking
  floor((P_r c_e + phase) / 1024) - floor((P_{r-1} c_e + phase) / 1024) of its c_e choices;
  `phase` = source index * 1024 // sources spreads the rounding over replicas. Every
  (source, slot) pair then carries ~ share x count, so fixed per-pair capacity suffices.
  Same rule as `moejax.planner.placement.split_loads`."""
  num_experts = expert_slots_ExR.shape[0]
  counts_E = jnp.zeros((num_experts,), jnp.int32).at[expert_A].add(1)
  cum_ExR = jnp.cumsum(expert_parts_ExR, axis=1)
  q, r = counts_E[:, None] // SHARE_PARTS, counts_E[:, None] % SHARE_PARTS
  bounds_ExR = cum_ExR * q + (cum_ExR * r + phase) // SHARE_PARTS
  rank_A = rank_within_expert(expert_A, num_experts)
  r_A = jnp.sum(bounds_ExR[expert_A] <= rank_A[:, None], axis=1)
  r_A = jnp.minimum(r_A, jnp.sum(expert_slots_ExR >= 0, axis=1)[expert_A] - 1)
  return jnp.take_along_axis(expert_slots_ExR[expert_A], r_A[:, None], axis=1)[:, 0]


def choose_slots(expert_A: jax.Array, counts_NxE: jax.Array, device: jax.Array,
                 expert_slots_ExR: jax.Array, expert_parts_ExR: jax.Array,
                 slots_per_device: int) -> jax.Array:
  """Slot for each of this device's choices `expert_A`; `device` is its index in the group."""
  num_devices, num_experts = counts_NxE.shape
  valid = expert_slots_ExR >= 0
  total_E = counts_NxE.sum(0)
  hi_ExR = _scaled_floor(jnp.cumsum(expert_parts_ExR, axis=1), total_E[:, None])
  quota_ExR = jnp.diff(hi_ExR, axis=1, prepend=0) * valid
  dev_ExR = jnp.where(valid, expert_slots_ExR // slots_per_device, num_devices)
  e_ExR = jnp.broadcast_to(jnp.arange(num_experts)[:, None], dev_ExR.shape)
  local_quota_NxE = jnp.zeros((num_devices + 1, num_experts), jnp.int32).at[
      dev_ExR, e_ExR].add(quota_ExR)[:num_devices]
  local_take_NxE = jnp.minimum(counts_NxE, local_quota_NxE)
  rem_NxE = counts_NxE - local_take_NxE
  offset_NxE = jnp.cumsum(rem_NxE, axis=0) - rem_NxE
  taken_ExR = jnp.where(valid, local_take_NxE[jnp.minimum(dev_ExR, num_devices - 1), e_ExR], 0)
  bounds_ExR = jnp.cumsum(quota_ExR - taken_ExR, axis=1)
  local_slot_E = jnp.max(jnp.where(dev_ExR == device, expert_slots_ExR, -1), axis=1)

  rank_A = rank_within_expert(expert_A, num_experts)
  take_A = local_take_NxE[device, expert_A]
  pos_A = offset_NxE[device, expert_A] + rank_A - take_A
  r_A = jnp.sum(bounds_ExR[expert_A] <= pos_A[:, None], axis=1)
  r_A = jnp.minimum(r_A, jnp.sum(valid, axis=1)[expert_A] - 1)
  remote_A = jnp.take_along_axis(expert_slots_ExR[expert_A], r_A[:, None], axis=1)[:, 0]
  return jnp.where(rank_A < take_A, local_slot_E[expert_A], remote_A).astype(jnp.int32)
