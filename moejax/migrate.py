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

from moejax.layout import Layout
from moejax.moe.layer import EXPERT_PARAM_AXES

_PERMUTERS: dict = {}


def path_keys(path) -> list:
  """The dict keys / attribute names along a pytree key path."""
  return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def is_expert_leaf(path) -> bool:
  """Expert weights live under a module named 'moe' as w_gate / w_up / w_down; the
  optimizer moments mirror the parameter tree, so they match too."""
  keys = path_keys(path)
  return "moe" in keys and keys[-1] in EXPERT_PARAM_AXES


def _gather_slots(tree: Any, src_LxS: jax.Array, select=is_expert_leaf) -> Any:
  """leaf[l, s] <- leaf[l, src[l, s]] for every leaf whose path `select` accepts."""
  def one(path, leaf):
    if not select(path):
      return leaf
    idx = src_LxS.reshape(src_LxS.shape + (1,) * (leaf.ndim - 2))
    return jnp.take_along_axis(leaf, idx, axis=1)
  return jax.tree_util.tree_map_with_path(one, tree)


def permute_slots(tree: Any, src_LxS: jax.Array, donate: bool = False) -> Any:
  """leaf[l, s] <- leaf[l, src[l, s]] for every expert leaf [L, S, ...]; shardings kept."""
  leaves, treedef = jax.tree.flatten(tree)
  shardings = tuple(x.sharding for x in leaves)
  key = (treedef, shardings, donate)
  if key not in _PERMUTERS:
    out_sh = jax.tree.unflatten(treedef, shardings)
    _PERMUTERS[key] = jax.jit(_gather_slots, out_shardings=out_sh,
                              donate_argnums=(0,) if donate else ())
  return _PERMUTERS[key](tree, src_LxS)


def migration_source(old: Layout, new: Layout) -> jax.Array:
  """For each new slot, the old slot that holds its expert: [L, S]."""
  return jnp.take_along_axis(old.expert_slot_LxE, new.slot_expert_LxS, axis=1)


def migrate(state: Any, old: Layout, new: Layout) -> Any:
  """Returns `state` with expert weights and optimizer moments in `new`'s slot order.
  The input state is donated."""
  return permute_slots(state, migration_source(old, new), donate=True)
