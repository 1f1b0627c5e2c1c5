"""The sharded MoE layer equals the single-device dense reference (outputs and grads)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import MoEConfig
from moejax.layout.tables import from_slot_expert, static_layout
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.harness import layer_step, reference_loss, run_against_reference
from moejax.model.moe.reference import moe_reference
from tests.moe_helpers import GRAD_LEN, LOSS_LEN, MESHES, Y_LEN, D, E, F, make_params, row
from tests.numerics import assert_close, assert_trees_close

# 1x8x1 (expert parallel only) with top-1 runs in the README's test command; the other cases
# (2x2x2 with all three axes among them) only in .ci/run's slow pass, to keep that command
# within 8 minutes.
FAST_LAYER_CASES = (((1, 8, 1), 1),)


@pytest.mark.parametrize("shape, top_k", [
    c if c in FAST_LAYER_CASES else pytest.param(*c, marks=pytest.mark.slow)
    for c in [(s, k) for s in MESHES for k in (1, 2)]
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_sharded_layer_matches_reference(shape, top_k):
  params = make_params()
  x = jax.random.normal(jax.random.key(1), (8, 8, D))
  # capacity_factor = E makes every (source, slot) buffer hold all of a source's choices.
  cfg = MoEConfig(num_experts=E, top_k=top_k, capacity_factor=float(E), d_ff=F)
  run = run_against_reference(cfg, mesh_of_shape(shape), params, x)   # the static layout

  assert run.dropped == 0
  np.testing.assert_array_equal(np.asarray(run.stats.counts_WxE).sum(0), run.ref_counts)
  assert run.stats.counts_WxE.shape == (shape[0] * shape[1], E)
  assert_close(run.y, run.ref_y, Y_LEN, err_msg="y")
  assert_close(run.loss, run.ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(run.grads, run.ref_grads, GRAD_LEN)


@pytest.mark.parametrize("shape", [pytest.param((1, 8, 1), marks=pytest.mark.slow),
                                   pytest.param((2, 4, 1), marks=pytest.mark.slow)],
                         ids=lambda s: "x".join(map(str, s)))
def test_permuted_layout_matches_reference(shape):
  """Weights stored in slot order under a non-trivial layout give the same layer (the harness
  puts expert e's weights in its slot and maps the gradients back to expert order)."""
  params = make_params(3)
  x = jax.random.normal(jax.random.key(4), (8, 8, D))
  slot_expert = np.random.default_rng(0).permutation(E)
  layout = from_slot_expert(slot_expert[None], E)
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=float(E), d_ff=F)
  run = run_against_reference(cfg, mesh_of_shape(shape), params, x, row(layout))
  assert_close(run.y, run.ref_y, Y_LEN, err_msg="y")
  assert_trees_close(run.grads[0], run.ref_grads[0], GRAD_LEN)


@pytest.mark.slow   # over the 8-minute budget of the README test command: .ci/run's slow pass
def test_overflow_is_dropped_and_counted():
  """All tokens pick experts 0 and 1 by construction; capacity is far too small."""
  shape = (1, 8, 1)
  params = make_params()
  router = np.full((D, E), -10.0, np.float32)
  router[:, 0], router[:, 1] = 10.0, 5.0
  params["router"] = jnp.asarray(router)
  x = jnp.abs(jax.random.normal(jax.random.key(2), (8, 8, D))) + 0.1   # positive: logits ordered
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=1.0, d_ff=F)
  layout = static_layout(1, E, 8)
  (_, (y, st)), _ = layer_step(cfg, mesh_of_shape(shape))(params, x, row(layout))
  tokens_per_source = 8     # batch 8 over 8 sources, L = 8 -> 8 tokens each
  cap = int(np.ceil(1.0 * tokens_per_source * 2 / E))    # 2 rows per (source, slot)
  counts = np.asarray(st.counts_WxE)
  np.testing.assert_array_equal(counts[:, 0], tokens_per_source)
  np.testing.assert_array_equal(counts[:, 1], tokens_per_source)
  # Each source keeps `cap` choices for each of the two hot slots, drops the rest.
  np.testing.assert_array_equal(np.asarray(st.dropped_W), 2 * (tokens_per_source - cap))
  # Each source's first `cap` tokens keep both choices and equal the reference; the later
  # ones lose both and get no expert output at all.
  ref_y = np.asarray(moe_reference(params, x, 2)[0]).reshape(8, tokens_per_source, D)
  y_tokens = np.asarray(y).reshape(8, tokens_per_source, D)
  assert_close(y_tokens[:, :cap], ref_y[:, :cap], Y_LEN, err_msg="kept tokens")
  assert np.all(y_tokens[:, cap:] == 0)


@pytest.mark.slow   # 8 s; test_routers' gate tests with the bias stay in the fast set
def test_router_bias_steers_choices_and_matches_reference():
  """A layout's router bias changes which experts are chosen (not the gates), equally in the
  sharded layer and the reference; a large bias on expert 5 makes it every token's choice."""
  params = make_params(5)
  x = jax.random.normal(jax.random.key(6), (8, 8, D))
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=float(E), d_ff=F)
  bias = np.zeros((1, E), np.float32)
  bias[0, 5] = 2.0
  layout = static_layout(1, E, 4).replace(router_bias_LxE=jnp.asarray(bias))
  run = run_against_reference(cfg, mesh_of_shape((2, 4, 1)), params, x, row(layout),
                              reference=reference_loss(cfg, bias_E=jnp.asarray(bias[0])))
  counts = np.asarray(run.stats.counts_WxE).sum(0)
  assert counts[5] == 8 * 8                       # every token picked expert 5
  np.testing.assert_array_equal(counts, run.ref_counts)
  assert_close(run.y, run.ref_y, Y_LEN, err_msg="y")
  assert_close(run.loss, run.ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(run.grads, run.ref_grads, GRAD_LEN)
