"""Move experts between slots in `ep` mode: weights and every optimizer-state leaf.

Two compiled programs per state structure and budget (cached), neither specialised to a
layout: the tables are traced int32 arguments, so any new layout reuses them.

- The moved-only program (`moved_slots`): each device packs the slots it must send into a
  fixed budget of B rows per destination device, one all-to-all over the expert axis carries
  them, and each device gathers its new slots from its own old ones and what it received. It
  sends N x B rows per device whatever moves, so it is used while no (source, destination)
  pair moves more than B slots.
- The whole permutation (`permute_slots`): a gather along the expert-sharded slot axis, which
  XLA partitions into collectives over every slot; for a layout change past the budget.

Nothing goes through the host but the small tables.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.layout.leaves import gather_slots, is_expert_leaf
from moejax.layout.tables import Layout

_PERMUTERS: dict = {}
_MOVERS: dict = {}


def _permuter(tree: Any, donate: bool):
  leaves, treedef = jax.tree.flatten(tree)
  shardings = tuple(x.sharding for x in leaves)
  key = (treedef, shardings, donate)
  if key not in _PERMUTERS:
    out_sh = jax.tree.unflatten(treedef, shardings)
    _PERMUTERS[key] = jax.jit(gather_slots, out_shardings=out_sh,
                              donate_argnums=(0,) if donate else ())
  return _PERMUTERS[key]


def permute_slots(tree: Any, src_LxS: jax.Array, donate: bool = False) -> Any:
  """leaf[l, s] <- leaf[l, src[l, s]] for every expert leaf [L, S, ...]; shardings kept."""
  return _permuter(tree, donate)(tree, src_LxS)


def migration_source(old: Layout, new: Layout) -> jax.Array:
  """For each new slot, the old slot that holds its expert: [L, S]."""
  return jnp.take_along_axis(old.expert_slot_LxE, new.slot_expert_LxS, axis=1)


def slot_axis(tree: Any, layers_slots: tuple[int, int]) -> tuple[Any, str, Any] | None:
  """(mesh, the mesh axis the expert leaves' slot axis is split over, their layer axis's
  spec), or None where there is no expert leaf, one is not [layers, slots, ...] or its slot
  axis is not split over exactly one mesh axis (the moved-only program then does not apply)."""
  found = None
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not is_expert_leaf(path):
      continue
    sh = getattr(leaf, "sharding", None)
    if (tuple(leaf.shape[:2]) != layers_slots or not isinstance(sh, NamedSharding) or
        len(sh.spec) < 2 or not isinstance(sh.spec[1], str)):
      return None
    this = (sh.mesh, sh.spec[1], sh.spec[0])
    if found is not None and this != found:
      return None
    found = this
  return found


def default_budget(slots: int, devices: int) -> int:
  """B: rows per (source, destination) pair. N x B rows per device is at most one device's
  own slots, so the moved-only program never sends more than a device holds."""
  return max(1, slots // devices // devices)


def plan_moves(src_LxS: np.ndarray, devices: int, budget: int):
  """The moved-only tables for `src_LxS` on `devices` (slot s on device s // (S/N)):
  `send_NxLxR` (R = N x B: which local slot each device packs for each destination, in
  destination-major blocks of B) and `pick_NxLxC` (C = S/N: each device's new local slot,
  indexed into its old local slots followed by the R rows it received, in source-major
  blocks of B), plus the slots that cross devices; None where a pair moves more than B."""
  layers, slots = src_LxS.shape
  c = slots // devices
  src_LxS = np.asarray(src_LxS, np.int64)
  layer_LxS = np.broadcast_to(np.arange(layers)[:, None], (layers, slots))
  dst_LxS = np.broadcast_to(np.arange(slots) // c, (layers, slots))
  from_LxS = src_LxS // c                                   # the device holding it now
  pick = np.zeros((devices, layers, c), np.int32)
  home = from_LxS == dst_LxS
  pick[dst_LxS[home], layer_LxS[home], np.nonzero(home)[1] % c] = src_LxS[home] % c
  # Each crossing slot's rank among its (layer, source, destination) pair's, in slot order.
  lay, s = np.nonzero(~home)
  pair = (lay * devices + from_LxS[lay, s]) * devices + dst_LxS[lay, s]
  order = np.argsort(pair, kind="stable")
  starts = np.searchsorted(pair[order], pair[order], side="left")
  rank = np.empty_like(pair)
  rank[order] = np.arange(len(pair)) - starts
  if len(rank) and rank.max() >= budget:
    return None
  send = np.zeros((devices, layers, devices * budget), np.int32)
  src_dev, dst_dev = from_LxS[lay, s], dst_LxS[lay, s]
  send[src_dev, lay, dst_dev * budget + rank] = src_LxS[lay, s] % c
  pick[dst_dev, lay, s % c] = c + src_dev * budget + rank
  return send, pick, len(pair)


def _moved_program(tree: Any, mesh, axis: str, layer_spec, budget: int):
  leaves, treedef = jax.tree.flatten(tree)
  shardings = tuple(x.sharding for x in leaves)
  key = (treedef, shardings, budget)
  if key in _MOVERS:
    return _MOVERS[key]
  table_spec = P(axis, layer_spec)

  def block(leaf_spec):
    def move(x, send_1xLxR, pick_1xLxC):   # x: this device's [L, C, ...] block
      tail = (1,) * (x.ndim - 2)
      packed = jnp.take_along_axis(x, send_1xLxR[0].reshape(send_1xLxR.shape[1:] + tail), 1)
      got = jax.lax.all_to_all(packed, axis, 1, 1, tiled=True)
      pool = jnp.concatenate([x, got], axis=1)
      return jnp.take_along_axis(pool, pick_1xLxC[0].reshape(pick_1xLxC.shape[1:] + tail), 1)
    return jax.shard_map(move, mesh=mesh, in_specs=(leaf_spec, table_spec, table_spec),
                         out_specs=leaf_spec, check_vma=False)

  out_sh = jax.tree.unflatten(treedef, shardings)

  def body(tree, send, pick):
    flat = jax.tree_util.tree_leaves_with_path(tree)
    out = [block(sh.spec)(x, send, pick) if is_expert_leaf(path) else x
           for (path, x), sh in zip(flat, shardings)]
    return jax.tree.unflatten(treedef, out)

  _MOVERS[key] = jax.jit(body, out_shardings=out_sh, donate_argnums=(0,))
  return _MOVERS[key]


def migration_call(state: Any, old: Layout, new: Layout, budget: int | None = None,
                   whole: bool = False) -> tuple[Any, tuple]:
  """(the compiled program, its arguments) that `migrate` runs for this change: the moved-only
  program while every (source, destination) pair moves at most `budget` (default
  `default_budget`), else (or with `whole`) the whole permutation. Apart from `migrate` so a
  benchmark can lower the very program the trainer runs."""
  src_LxS = migration_source(old, new)
  where = None if whole else slot_axis(state, tuple(src_LxS.shape))
  if where is not None:
    mesh, axis, layer_spec = where
    devices = mesh.shape[axis]
    slots = src_LxS.shape[1]
    b = budget or default_budget(slots, devices)
    plan = plan_moves(np.asarray(jax.device_get(src_LxS)), devices, b)
    if plan is not None:
      send, pick, _ = plan
      table = NamedSharding(mesh, P(axis, layer_spec))
      return (_moved_program(state, mesh, axis, layer_spec, b),
              (state, jax.device_put(send, table), jax.device_put(pick, table)))
  return _permuter(state, donate=True), (state, src_LxS)


def migrate(state: Any, old: Layout, new: Layout, budget: int | None = None,
            whole: bool = False) -> Any:
  """Returns `state` with expert weights and optimizer moments in `new`'s slot order, moving
  only the slots whose expert comes from another device (`migration_call` says which
  program). The input state is donated."""
  fn, args = migration_call(state, old, new, budget, whole)
  return fn(*args)
