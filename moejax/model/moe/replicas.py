"""Choose a replica slot for every (token, k) choice, inside shard_map (fsep layouts).

`split_slots` splits each source's choices of an expert over its replicas by the planned
shares, so every (source, slot) pair carries about share x count and the dense dispatch's
fixed per-pair capacity suffices. The device-side twin of the host's "split" rule
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


def split_slots(expert_A: jax.Array, expert_slots_ExR: jax.Array,
                expert_parts_ExR: jax.Array, phase: jax.Array) -> jax.Array:
  """Proportional split (what the dense dispatch uses): this device's choices of expert e,
  in token order, go to e's replicas in slot order, replica r taking
  floor((P_r c_e + phase) / 1024) - floor((P_{r-1} c_e + phase) / 1024) of its c_e choices;
  `phase` = source index * 1024 // sources spreads the rounding over replicas. Every
  (source, slot) pair then carries ~ share x count, so fixed per-pair capacity suffices.
  Same rule as `moejax.layout.placement.split_loads`."""
  num_experts = expert_slots_ExR.shape[0]
  counts_E = jnp.zeros((num_experts,), jnp.int32).at[expert_A].add(1)
  cum_ExR = jnp.cumsum(expert_parts_ExR, axis=1)
  q, r = counts_E[:, None] // SHARE_PARTS, counts_E[:, None] % SHARE_PARTS
  bounds_ExR = cum_ExR * q + (cum_ExR * r + phase) // SHARE_PARTS
  rank_A = rank_within_expert(expert_A, num_experts)
  r_A = jnp.sum(bounds_ExR[expert_A] <= rank_A[:, None], axis=1)
  r_A = jnp.minimum(r_A, jnp.sum(expert_slots_ExR >= 0, axis=1)[expert_A] - 1)
  return jnp.take_along_axis(expert_slots_ExR[expert_A], r_A[:, None], axis=1)[:, 0]
