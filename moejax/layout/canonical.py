"""Expert weights across strategies: canonical (expert-id) order and the ep <-> fsep tree paths.

`ep` keeps expert weights (and, mirrored, their optimizer moments) at `...['layers']['moe'][w]`
in *slot* order; `fsep` keeps them at `...['fsep_experts'][w]` in expert-id order. Both are
`[L, E, D, ffn]` (w_gate, w_up) and `[L, E, ffn, D]` (w_down); only their shardings differ. So a
state moves between strategies as: `canonical_state` (ep slots -> expert-id order), then
`convert_tree` (move the leaves to the other mode's paths), then a reshard, then
`from_canonical_state` under the new layout.
"""

from __future__ import annotations

from typing import Any

import jax

from moejax.layout.leaves import EXPERT_WEIGHTS, is_expert_leaf
from moejax.layout.migrate import permute_slots
from moejax.layout.tables import Layout

MODES = ("ep", "fsep")


def _permute_expert_leaves(tree: Any, src_LxS: jax.Array) -> Any:
  """permute_slots on the ep expert leaves only (the rest is not copied)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  mask = [is_expert_leaf(path) for path, _ in flat]
  if not any(mask):
    return tree
  pruned = jax.tree_util.tree_map_with_path(lambda p, x: x if is_expert_leaf(p) else None, tree)
  moved = iter(jax.tree.leaves(permute_slots(pruned, src_LxS)))
  return jax.tree.unflatten(treedef, [next(moved) if m else x for m, (_, x) in zip(mask, flat)])


def to_canonical(tree: Any, layout: Layout) -> Any:
  """ep slot order -> expert-id order (row e = expert e's weights)."""
  return _permute_expert_leaves(tree, layout.expert_slot_LxE)


def from_canonical(tree: Any, layout: Layout) -> Any:
  """Expert-id order -> the ep slot order of `layout`."""
  return _permute_expert_leaves(tree, layout.slot_expert_LxS)


def _check_mode(mode: str) -> None:
  if mode not in MODES:
    raise ValueError(f"expert mode {mode!r} is not one of {MODES}")


def canonical_state(state: Any, layout: Layout, expert_mode: str) -> Any:
  """`state` with expert weights in expert-id order (ep: un-permuted by `layout`; fsep: as is)."""
  _check_mode(expert_mode)
  return to_canonical(state, layout) if expert_mode == "ep" else state


def from_canonical_state(state: Any, layout: Layout, expert_mode: str) -> Any:
  """Inverse of `canonical_state`: ep slots in `layout`'s order; fsep unchanged."""
  _check_mode(expert_mode)
  return from_canonical(state, layout) if expert_mode == "ep" else state


def _is_param_root(x: Any) -> bool:
  """A dict mirroring the params: it has layers/moe (the router lives there in both modes)."""
  return (isinstance(x, dict) and isinstance(x.get("layers"), dict) and
          isinstance(x["layers"].get("moe"), dict))


def _ep_to_fsep(root: dict) -> dict:
  moe = dict(root["layers"]["moe"])
  experts = {w: moe.pop(w) for w in EXPERT_WEIGHTS if w in moe}
  if not experts:
    return root
  return dict(root, layers=dict(root["layers"], moe=moe), fsep_experts=experts)


def _fsep_to_ep(root: dict) -> dict:
  if "fsep_experts" not in root:
    return root
  root = dict(root)
  experts = root.pop("fsep_experts")
  return dict(root, layers=dict(root["layers"], moe=dict(root["layers"]["moe"], **experts)))


def convert_tree(tree: Any, src_mode: str, dst_mode: str) -> Any:
  """Moves expert leaves from `src_mode`'s paths to `dst_mode`'s in every params-like subtree.

  Works on any tree mirroring the params (params, Adam mu/nu, a whole TrainState, shardings),
  with arrays or `jax.ShapeDtypeStruct` leaves; values and order are untouched, so pass
  canonical (expert-id ordered) trees. Identity when the modes are equal.
  """
  _check_mode(src_mode)
  _check_mode(dst_mode)
  if src_mode == dst_mode:
    return tree
  move = _ep_to_fsep if dst_mode == "fsep" else _fsep_to_ep
  return jax.tree.map(lambda x: move(x) if _is_param_root(x) else x, tree,
                      is_leaf=_is_param_root)
