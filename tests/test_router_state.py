"""The aux-loss-free router bias as train state: the step's update equals a numpy replay over
20 steps; the bias follows its expert through a migration, survives a checkpoint, and an
ep -> fsep -> ep restore. Plus the model with dense first layers and a shared expert, on a
mesh with a 'model' axis, against one device.

The tests that compile and train the model carry the `slow` marker (each took minutes on the
shared 2-core VM); the update rule itself is also checked host-only, in the default run."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import CheckpointConfig, MoEConfig
from moejax.layout.migrate import migrate
from moejax.layout.tables import from_slot_expert
from moejax.train import step as step_lib
from moejax.train.checkpoint import Checkpointer
from tests.helpers import TINY_MODEL, tokens
from tests.moe_helpers import (
  SMALL_MODEL,
  SMALL_MOE,
  cached_setup,
  model_lengths,
  model_loss_and_grads,
)
from tests.numerics import assert_close, assert_trees_close

RATE = 0.01
SIGMOID_MOE = dataclasses.replace(SMALL_MOE, gate="sigmoid", bias_rate=RATE, route_scale=2.0,
                                  capacity_factor=2.0)


def _step_fn(model, tx, shardings, moe_cfg):
  return jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, moe_cfg=moe_cfg,
                                   lr_schedule=lambda s: 0.0),
                 in_shardings=(shardings, None, None), out_shardings=(shardings, None),
                 donate_argnums=0)


@pytest.fixture(scope="module")
def trained():
  """20 steps of the 2-MoE-layer model, sigmoid gate, bias rate 0.01, on 2 x 4 x 1; with the
  per-step counts and the compiled step."""
  mesh, model, tx, layout, shardings, state = cached_setup((2, 4, 1), SMALL_MODEL, SIGMOID_MOE)
  step = _step_fn(model, tx, shardings, SIGMOID_MOE)
  biases, counts = [np.asarray(state.router_bias_LxE)], []
  for i in range(20):
    state, metrics = step(state, tokens(100 + i), layout)
    biases.append(np.asarray(state.router_bias_LxE))
    counts.append(np.asarray(metrics["counts_LxWxE"]))
  return dict(mesh=mesh, layout=layout, shardings=shardings, state=state, step=step,
              biases=biases, counts=counts)


def test_update_rule_equals_numpy_over_20_steps():
  """`update_bias` on 20 steps of random counts [L, W, E], against numpy."""
  rng = np.random.default_rng(0)
  bias, want = jnp.zeros((2, 8), jnp.float32), np.zeros((2, 8))
  for _ in range(20):
    counts_LxWxE = rng.poisson(rng.uniform(1, 30, size=(2, 1, 8)), size=(2, 4, 8))
    bias = step_lib.update_bias(bias, jnp.asarray(counts_LxWxE, jnp.int32), RATE)
    load = counts_LxWxE.sum(1)
    want = want + RATE * np.sign(load.mean(-1, keepdims=True) - load)
  np.testing.assert_allclose(np.asarray(bias), want, rtol=0, atol=1e-6)
  assert np.abs(want).max() >= 5 * RATE


@pytest.mark.slow
def test_bias_update_equals_numpy_over_20_steps(trained):
  bias = np.zeros_like(trained["biases"][0])
  for i, counts_LxWxE in enumerate(trained["counts"]):
    load_LxE = counts_LxWxE.sum(1).astype(np.float64)
    bias = bias + RATE * np.sign(load_LxE.mean(-1, keepdims=True) - load_LxE)
    # Each step adds +-rate or 0 in float32: exact up to float32 rounding of the sums.
    np.testing.assert_allclose(trained["biases"][i + 1], bias, rtol=0, atol=1e-6, err_msg=i)
  assert np.abs(bias).max() >= 2 * RATE        # it moved: loads were unequal
  # The bias is not a gradient leaf: the optimizer state mirrors the params only.
  assert "router_bias_LxE" not in str(jax.tree_util.tree_structure(trained["state"].opt_state))


@pytest.mark.slow
def test_bias_follows_expert_through_migration_and_checkpoints(trained, tmp_path):
  state, layout, step = trained["state"], trained["layout"], trained["step"]
  bias = np.asarray(state.router_bias_LxE)
  copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=trained["shardings"])
  # Migration: expert e's weights move to another slot; its bias entry stays e's (expert-id
  # indexed), so the next step chooses the same experts and updates the bias identically.
  order = np.array([[3, 7, 0, 5, 1, 6, 2, 4], [6, 2, 4, 0, 7, 1, 5, 3]])
  permuted = jax.device_put(from_slot_expert(order, 8), layout.expert_slots_LxExR.sharding)
  moved = migrate(copy(state), layout, permuted)
  np.testing.assert_array_equal(moved.router_bias_LxE, bias)
  after_a, m_a = step(copy(state), tokens(7), layout)
  after_b, m_b = step(moved, tokens(7), permuted)
  np.testing.assert_array_equal(m_a["counts_LxWxE"].sum(1), m_b["counts_LxWxE"].sum(1))
  np.testing.assert_array_equal(after_a.router_bias_LxE, after_b.router_bias_LxE)

  # Checkpoint under the permuted layout, restore in ep, then in fsep, then fsep -> ep.
  ckpt = Checkpointer(str(tmp_path / "ck"), CheckpointConfig())
  ckpt.save(1, after_b, permuted, {"data_position": 1}, "ep")
  ckpt.wait()
  back = ckpt.restore(copy(state), layout, "ep")
  np.testing.assert_array_equal(back.state.router_bias_LxE, after_b.router_bias_LxE)
  fsep_moe = dataclasses.replace(SIGMOID_MOE, expert_mode="fsep")
  _, _, _, fsep_layout, _, fsep_state = cached_setup((2, 4, 1), SMALL_MODEL, fsep_moe)
  as_fsep = ckpt.restore(fsep_state, fsep_layout, "fsep")
  np.testing.assert_array_equal(as_fsep.state.router_bias_LxE, after_b.router_bias_LxE)
  ckpt.save(2, as_fsep.state, as_fsep.layout, {"data_position": 2}, "fsep")
  ckpt.wait()
  as_ep = ckpt.restore(copy(state), layout, "ep")
  assert as_ep.step == 2
  np.testing.assert_array_equal(as_ep.state.router_bias_LxE, after_b.router_bias_LxE)
  ckpt.close()


FAMILY_MODEL = dataclasses.replace(TINY_MODEL, num_layers=3)
FAMILY_MOE = MoEConfig(num_experts=8, top_k=2, capacity_factor=8.0, d_ff=32, moe_every=2,
                       first_dense=1, num_shared_experts=2, shared_d_ff=16, gate="sigmoid",
                       route_scale=2.0)


@pytest.mark.slow
def test_first_dense_and_shared_experts_on_mesh_match_one_device():
  """Layer 0 dense, then one scanned group (a dense block and an MoE block with 2 shared
  experts of width 16 beside it); tensor-parallel over 'model' = 2 on the mesh."""
  loss_len, grad_len = model_lengths(FAMILY_MODEL, FAMILY_MOE)
  ref_loss, ref_grads, ref_aux, _ = model_loss_and_grads((1, 1, 1), FAMILY_MODEL, FAMILY_MOE)
  loss, grads, aux, state = model_loss_and_grads((2, 2, 2), FAMILY_MODEL, FAMILY_MOE)
  assert sorted(k for k in grads if k.startswith("first_")) == [
      "first_attn_0", "first_ln_attn_0", "first_ln_mlp_0", "first_mlp_0"]
  shared = state.params["layers"]["shared"]["w_gate"]
  assert shared.shape == (1, 32, 2 * 16)
  assert "model" in str(shared.sharding.spec)      # the shared width is split over 'model'
  assert aux["counts_LxWxE"].shape[0] == 1         # one MoE layer
  assert int(np.sum(aux["dropped_LxW"])) == 0
  np.testing.assert_array_equal(aux["counts_LxWxE"].sum(1), ref_aux["counts_LxWxE"].sum(1))
  assert_close(loss, ref_loss, loss_len, err_msg="loss")
  assert_trees_close(grads, ref_grads, grad_len)


@pytest.mark.slow
def test_checkpoint_from_before_the_bias_restores_with_a_zero_bias(tmp_path):
  """A run dir written before the bias was train state (no router_bias_LxE in the saved tree)
  resumes: weights and step as saved, the bias at zero, as a fresh run would start."""
  _, _, _, layout, _, state = cached_setup((2, 4, 1), SMALL_MODEL, SMALL_MOE)
  trained_like = state.replace(step=state.step + 5,
                               router_bias_LxE=state.router_bias_LxE + 1.0)
  legacy = {"step": trained_like.step, "params": trained_like.params,
            "opt_state": trained_like.opt_state}
  ckpt = Checkpointer(str(tmp_path / "ck"), CheckpointConfig())
  ckpt.save(5, legacy, layout, {"data_position": 5}, "ep")
  ckpt.wait()
  back = ckpt.restore(trained_like, layout, "ep")
  ckpt.close()
  assert back.step == 5 and int(back.state.step) == 5
  np.testing.assert_array_equal(back.state.router_bias_LxE,
                                np.zeros(state.router_bias_LxE.shape, np.float32))
  assert back.state.router_bias_LxE.sharding == trained_like.router_bias_LxE.sharding
  for a, b in zip(jax.tree.leaves(back.state.params), jax.tree.leaves(trained_like.params)):
    np.testing.assert_array_equal(a, b)
