"""Move experts between slots in `ep` mode: weights and every optimizer-state leaf.

One jitted program per state structure (cached): the slot permutation is a
traced int32 argument, so any new layout reuses the same executable. XLA
partitions the gather along the expert-sharded slot axis into a collective over
the expert axis; nothing goes through the host.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from moejax.layout.leaves import gather_slots
from moejax.layout.tables import Layout

_PERMUTERS: dict = {}


def permute_slots(tree: Any, src_LxS: jax.Array, donate: bool = False) -> Any:
  """leaf[l, s] <- leaf[l, src[l, s]] for every expert leaf [L, S, ...]; shardings kept."""
  leaves, treedef = jax.tree.flatten(tree)
  shardings = tuple(x.sharding for x in leaves)
  key = (treedef, shardings, donate)
  if key not in _PERMUTERS:
    out_sh = jax.tree.unflatten(treedef, shardings)
    _PERMUTERS[key] = jax.jit(gather_slots, out_shardings=out_sh,
                              donate_argnums=(0,) if donate else ())
  return _PERMUTERS[key](tree, src_LxS)


def migration_source(old: Layout, new: Layout) -> jax.Array:
  """For each new slot, the old slot that holds its expert: [L, S]."""
  return jnp.take_along_axis(old.expert_slot_LxE, new.slot_expert_LxS, axis=1)


def migrate(state: Any, old: Layout, new: Layout) -> Any:
  """Returns `state` with expert weights and optimizer moments in `new`'s slot order.
  The input state is donated."""
  return permute_slots(state, migration_source(old, new), donate=True)
