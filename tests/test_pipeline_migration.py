"""A SmartMoE re-placement under the circular schedule moves what it moves at one stage.

Under circular stages (V = 2) the state's layer axis is stored stage-major
(moejax.model.layer_order), while layouts and the planner's placements are canonical. The
re-planning controller migrates with the layouts put in the state's order
(`Program.state_layout`); this test checks that call against the one-stage program: the same
canonical state, migrated to the same SmartMoE placements, is the same canonical state after.
To stay cheap it compiles no step and no init (`compile_now=False`, the state's shapes from
`abstract_state`) and permutes on one device; the sharded migrations of a circular run,
checked against one device's losses, are in test_pipeline_pool.py (slow).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import Config, DataConfig, ModelConfig, MoEConfig, OptimConfig, PlannerConfig
from moejax.layout.migrate import migrate
from moejax.layout.tables import from_slot_expert, to_placements
from moejax.model import layer_order
from moejax.placement.replanner import OnlinePlanner
from moejax.strategy.spec import parse
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import build_program
from tests.plan_helpers import PLAN_COST

# Four MoE layers: at P = 2, V = 2 stage 0 stores canonical groups 0 and 2, stage 1 1 and 3.
CFG = Config(model=ModelConfig(d_model=32, num_layers=4, num_heads=2, d_ff=64, max_seq_len=16),
             moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=4.0, d_ff=32, moe_every=1),
             data=DataConfig(seq_len=16, global_batch_size=8),
             optim=OptimConfig(learning_rate=1e-2, warmup_steps=1),
             planner=PlannerConfig(policy="smartmoe", every=1, window=1))
TX = optimizer(CFG.optim, 10)


@pytest.fixture(scope="module")
def circular():
  """The P = 2, V = 2 program (expert axis 4): its state's shapes, order and layouts."""
  return build_program(CFG, parse("ep/1x4x1/p2/v2/m2/cf4"), TX, schedule(CFG.optim, 10),
                       compile_now=False)


def _random_state(prog):
  """A train state of `prog`'s shapes whose every float leaf (weights, Adam moments) is
  random, canonical layer order, on the host."""
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype)
                      if jnp.issubdtype(a.dtype, jnp.floating) else np.zeros(a.shape, a.dtype),
                      prog.abstract_state(TX))


def _smartmoe_layout(prog):
  """The SmartMoE planner's placements after a step where layer l's load sits on experts 2l
  and 2l + 1 (both on device l of the static layout): every layer moves, each its own way."""
  planner = OnlinePlanner(CFG.planner, 4, capacity_factor=4.0, capacity="slot", cost=PLAN_COST)
  counts_LxWxE = np.ones((4, 4, 8))
  for layer in range(4):
    counts_LxWxE[layer, :, 2 * layer: 2 * layer + 2] = 50.0
  planner.observe(counts_LxWxE)
  new, switches = planner.propose(to_placements(prog.layout, 4))
  assert len({sw.layer for sw in switches}) == 4, "every layer is re-placed"
  table = np.stack([p.slot_expert for p in new])
  # Canonical layers 1 and 2 swap rows in the circular storage (0, 2, 1, 3).
  assert not np.array_equal(table[1], table[2]), "the swapped layers are placed apart"
  return jax.device_put(from_slot_expert(table, 8), prog.layout_sharding)


def _assert_identical(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(a)),
                          jax.tree.leaves(jax.device_get(b)), strict=True):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_migration_under_the_circular_order_equals_one_stage(circular):
  """The one-stage state is the canonical one (P = 1 stores canonical rows); both migrate on
  one device, so only the layer order differs."""
  order = circular.layer_order
  assert not layer_order.is_identity(order)
  host = _random_state(circular)
  new = jax.device_get(_smartmoe_layout(circular))
  start = jax.device_get(circular.layout)
  want = jax.device_get(migrate(jax.device_put(host), start, new))
  stored = layer_order.reorder_state(host, order)   # the circular run's own storage
  got = migrate(jax.device_put(stored), circular.state_layout(start),
                circular.state_layout(new))
  _assert_identical(layer_order.reorder_state(jax.device_get(got), layer_order.inverse(order)),
                    want)
  # The migration moved expert weights and Adam moments, and the reordering is what made it
  # right: the canonical layouts applied to the stored rows give another state.
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(want.opt_state),
                                                      jax.tree.leaves(host.opt_state)))
  wrong = jax.device_get(migrate(jax.device_put(stored), start, new))
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(layer_order.reorder_state(wrong, layer_order.inverse(order)).params),
      jax.tree.leaves(want.params)))


def test_a_pool_move_reads_the_layouts_in_the_stored_order(circular):
  """A switch between members (`programs._move_ordered`, what `Transfer` compiles) from a
  SmartMoE-placed circular member to an ep member in expert order: the same canonical state
  as the move at one stage, both when the target shares the circular order (a pool's case)
  and when it stores canonical rows (via canonical order)."""
  from moejax.train.programs import _move, _move_ordered

  order, flat = circular.layer_order, np.arange(4)
  host = _random_state(circular)
  placed = jax.device_get(_smartmoe_layout(circular))
  target = jax.device_get(circular.layout)
  move = dict(src_mode="ep", dst_mode="ep", dst_shardings=None)
  want = jax.device_get(_move(jax.device_put(host), placed, target, **move))
  stored = jax.device_put(layer_order.reorder_state(host, order))
  same = jax.device_get(_move_ordered(stored, placed, target, src_order=order, dst_order=order,
                                      **move))
  _assert_identical(layer_order.reorder_state(same, layer_order.inverse(order)), want)
  to_flat = _move_ordered(stored, placed, target, src_order=order, dst_order=flat, **move)
  _assert_identical(to_flat, want)
  wrong = jax.device_get(_move(stored, placed, target, **move))   # canonical rows on storage
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(layer_order.reorder_state(wrong, layer_order.inverse(order)).params),
      jax.tree.leaves(want.params)))
