"""Choose a replica slot for every (token, k) choice, inside shard_map (fsep layouts).

`split_slots` first keeps the planned local parts of each source's choices of an expert on
its own device's replica (per-source shares), then splits the rest over the expert's replicas
by the planned shares, so every (source, slot) pair carries about share x count and the dense
dispatch's fixed per-pair capacity suffices. The device-side twin of the host's "split" rule
(`moejax.layout.placement.split_loads`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.layout.placement import SHARE_PARTS


def rank_within_expert(expert_A: jax.Array, num_experts: int) -> jax.Array:
  """For each choice, how many earlier choices on this device picked the same expert."""
  n = expert_A.shape[0]
  order = jnp.argsort(expert_A, stable=True)
  counts = jnp.zeros((num_experts,), jnp.int32).at[expert_A].add(1)
  starts = jnp.cumsum(counts) - counts
  ranks_sorted = jnp.arange(n, dtype=jnp.int32) - starts[expert_A[order]]
  return jnp.zeros((n,), jnp.int32).at[order].set(ranks_sorted)


def _scaled_floor(parts: jax.Array, count: jax.Array, phase: jax.Array | int = 0) -> jax.Array:
  """floor((parts * count + phase) / SHARE_PARTS) without int32 overflow of parts * count."""
  q, r = count // SHARE_PARTS, count % SHARE_PARTS
  return parts * q + (parts * r + phase) // SHARE_PARTS


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


def split_slots(expert_A: jax.Array, expert_slots_ExR: jax.Array,
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
  `moejax.layout.placement.split_loads`."""
  num_experts = expert_slots_ExR.shape[0]
  counts_E = jnp.zeros((num_experts,), jnp.int32).at[expert_A].add(1)
  rank_A = rank_within_expert(expert_A, num_experts)
  kept_E = 0 if kept_parts_E is None else _scaled_floor(kept_parts_E, counts_E)
  cum_ExR = jnp.cumsum(expert_parts_ExR, axis=1)
  bounds_ExR = _scaled_floor(cum_ExR, (counts_E - kept_E)[:, None], phase)
  rest_A = rank_A - (0 if kept_parts_E is None else kept_E[expert_A])
  r_A = jnp.sum(bounds_ExR[expert_A] <= rest_A[:, None], axis=1)
  r_A = jnp.minimum(r_A, jnp.sum(expert_slots_ExR >= 0, axis=1)[expert_A] - 1)
  slot_A = jnp.take_along_axis(expert_slots_ExR[expert_A], r_A[:, None], axis=1)[:, 0]
  if kept_parts_E is None:
    return slot_A
  return jnp.where(rest_A < 0, local_slot_E[expert_A], slot_A)
