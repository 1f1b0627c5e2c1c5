"""Where expert weights sit in a parameter (or optimizer-moment) tree: the one home of their names.

`ep` keeps them under a module named `moe` in slot order; `fsep` keeps them under
`fsep_experts` in expert-id order. Optimizer moments mirror the parameter tree, so the same
tests select them too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def path_keys(path) -> list:
  """The dict keys / attribute names along a pytree key path."""
  return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def is_expert_leaf(path) -> bool:
  """An ep expert weight (or its optimizer moment): `...['moe'][w]`."""
  keys = path_keys(path)
  return "moe" in keys and keys[-1] in EXPERT_WEIGHTS


def is_fsep_expert_leaf(path) -> bool:
  """An fsep expert weight (or its optimizer moment): `...['fsep_experts'][w]`."""
  keys = path_keys(path)
  return "fsep_experts" in keys and keys[-1] in EXPERT_WEIGHTS


def gather_slots(tree: Any, src_LxS: jax.Array, select=is_expert_leaf) -> Any:
  """leaf[l, s] <- leaf[l, src[l, s]] for every leaf [L, S, ...] whose path `select` accepts."""
  def one(path, leaf):
    if not select(path):
      return leaf
    idx = src_LxS.reshape(src_LxS.shape + (1,) * (leaf.ndim - 2))
    return jnp.take_along_axis(leaf, idx, axis=1)
  return jax.tree_util.tree_map_with_path(one, tree)
