"""ep migration moves only the slots whose expert comes from another device: one all-to-all of
a fixed budget of rows per device pair, the same state as the whole permutation, one compiled
program for every layout within the budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.aot.read import collective_summary, collectives
from moejax.layout import migrate
from moejax.layout.tables import from_slot_expert

LAYERS, SLOTS, D, F = 2, 32, 16, 8
DEVICES = 4          # the expert axis of the (2, 4, 1) mesh: 8 slots a device


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, DEVICES, 1),
                           ("data", "expert", "model"))


def _state(mesh, seed=0):
  """Weights and both Adam moments of the expert leaves, sharded as the trainer's, and a
  replicated leaf the migration must leave alone."""
  rng = np.random.default_rng(seed)

  def leaf(spec):
    x = rng.normal(size=(LAYERS, SLOTS, D, F)).astype(np.float32)
    return jax.device_put(x, NamedSharding(mesh, spec))
  experts = lambda: {"moe": {"w_up": leaf(P(None, "expert", None, "model")),   # noqa: E731
                             "w_down": leaf(P(None, "expert", "model", None))}}
  return {"params": experts(), "mu": experts(), "nu": experts(), "embed": leaf(P())}


def _swaps(rng, pairs: int, base=None) -> np.ndarray:
  """slot_expert [L, S]: `pairs` random swaps of experts per layer from `base` (the
  identity)."""
  se = np.stack([np.arange(SLOTS)] * LAYERS) if base is None else base.copy()
  for layer in range(LAYERS):
    for _ in range(pairs):
      a, b = rng.choice(SLOTS, 2, replace=False)
      se[layer, [a, b]] = se[layer, [b, a]]
  return se


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def test_moved_only_equals_the_whole_permutation_and_compiles_once():
  mesh = _mesh()
  state = _state(mesh)
  rng = np.random.default_rng(1)
  layout, host = from_slot_expert(np.stack([np.arange(SLOTS)] * LAYERS), SLOTS), jax.device_get(
      state)
  budget = migrate.default_budget(SLOTS, DEVICES)
  assert budget == 2   # 8 slots a device over 4 devices: 2 rows a pair
  before = {k: f._cache_size() for k, f in migrate._MOVERS.items()}
  moved_only = 0
  for step in range(5):
    new = from_slot_expert(_swaps(rng, 1 + step % 2, np.asarray(layout.slot_expert_LxS)), SLOTS)
    src = np.asarray(migrate.migration_source(layout, new))
    moved_only += migrate.plan_moves(src, DEVICES, budget) is not None
    want = _copy(state)
    want = migrate.migrate(want, layout, new, whole=True)
    state = migrate.migrate(state, layout, new)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
      assert a.sharding == b.sharding
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = (np.arange(LAYERS)[:, None], src)
    host = {k: (v if k == "embed" else jax.tree.map(lambda x, rows=rows: x[rows], v))
            for k, v in host.items()}
    layout = new
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(host)):
    np.testing.assert_array_equal(np.asarray(a), b)
  assert moved_only == 5, "one or two swaps a layer fit the budget"
  grown = sum(f._cache_size() - before.get(k, 0) for k, f in migrate._MOVERS.items())
  assert grown == 1, f"5 layouts compiled {grown} moved-only programs, expected 1"


def test_past_the_budget_the_whole_permutation_runs():
  mesh = _mesh()
  state = _state(mesh, seed=2)
  old = from_slot_expert(np.stack([np.arange(SLOTS)] * LAYERS), SLOTS)
  se = np.stack([np.roll(np.arange(SLOTS), 8)] * LAYERS)   # every slot to the next device
  assert migrate.plan_moves(se, DEVICES, 2) is None
  want = jax.tree.map(lambda x: np.asarray(x)[:, se[0]], jax.device_get(state))
  got = migrate.migrate(state, old, from_slot_expert(se, SLOTS))
  for k in ("params", "mu", "nu"):
    for a, b in zip(jax.tree.leaves(got[k]), jax.tree.leaves(want[k])):
      np.testing.assert_array_equal(np.asarray(a), b)


def test_the_compiled_program_sends_the_budget_not_every_slot():
  mesh = _mesh()
  state = _state(mesh)
  old = from_slot_expert(np.stack([np.arange(SLOTS)] * LAYERS), SLOTS)
  new = from_slot_expert(_swaps(np.random.default_rng(3), 1), SLOTS)
  src = migrate.migration_source(old, new)
  budget = migrate.default_budget(SLOTS, DEVICES)
  send, pick, crossing = migrate.plan_moves(np.asarray(src), DEVICES, budget)
  assert crossing <= 2 * LAYERS
  table = NamedSharding(mesh, P("expert", None))
  moved = migrate._moved_program(state, mesh, "expert", None, budget).lower(
      state, jax.device_put(send, table), jax.device_put(pick, table)).compile().as_text()
  whole = jax.jit(migrate.gather_slots).lower(state, src).compile().as_text()
  got, ref = collective_summary(collectives(moved)), collective_summary(collectives(whole))
  assert set(got) == {"all-to-all"}, got
  leaves = 6      # w_up and w_down of the weights and both moments
  per_leaf = LAYERS * DEVICES * budget * D * F * 4   # [L, N x B] rows of D x F floats
  assert got["all-to-all"]["bytes"] == leaves * per_leaf
  whole_bytes = sum(v["bytes"] for v in ref.values())
  assert whole_bytes >= leaves * LAYERS * SLOTS * D * F * 4, ref   # every slot, every leaf
  assert got["all-to-all"]["bytes"] * 4 <= whole_bytes


def test_the_tables_move_every_slot_to_its_place():
  """The moved-only program simulated in numpy (pack, all-to-all, pick) on random layouts:
  the tables put every expert where the new layout wants it, and a plan is refused exactly
  where a device pair moves more than the budget."""
  rng = np.random.default_rng(4)
  outcomes = set()
  for devices, slots, budget in ((4, 32, 2), (8, 32, 1), (2, 8, 3)):
    c = slots // devices
    for _ in range(20):
      src = np.stack([np.arange(slots)] * LAYERS)
      for layer in range(LAYERS):
        if rng.random() < 0.3:
          src[layer] = rng.permutation(slots)
        for _ in range(2):   # else a few swaps
          a, b = rng.choice(slots, 2, replace=False)
          src[layer, [a, b]] = src[layer, [b, a]]
      cross = [(layer, g // c, s // c) for layer in range(LAYERS) for s, g in enumerate(src[layer])
               if g // c != s // c]
      fits = all(cross.count(k) <= budget for k in set(cross))
      plan = migrate.plan_moves(src, devices, budget)
      assert (plan is not None) == fits
      outcomes.add(fits)
      if plan is None:
        continue
      send, pick, crossing = plan
      assert crossing == len(cross)
      old = np.arange(LAYERS * slots).reshape(LAYERS, slots)     # each slot's own id
      blocks = old.reshape(LAYERS, devices, c).transpose(1, 0, 2)   # [N, L, C]
      packed = np.take_along_axis(blocks, send, 2).reshape(devices, LAYERS, devices, budget)
      got = packed.transpose(2, 1, 0, 3).reshape(devices, LAYERS, devices * budget)
      pool = np.concatenate([blocks, got], 2)
      new = np.take_along_axis(pool, pick, 2).transpose(1, 0, 2).reshape(LAYERS, slots)
      np.testing.assert_array_equal(new, np.take_along_axis(old, src, 1))
  assert outcomes == {True, False}
