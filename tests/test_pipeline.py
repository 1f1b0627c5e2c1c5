"""The pipeline over `stage` equals one device (loss and every gradient).

The reference runs the unpipelined Transformer on one device, microbatch by microbatch
(rows i % M == m), and averages their losses and gradients: the pipeline's definition of the
step. Each case compiles a pipelined program (minutes on this 2-core VM), hence `slow`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from moejax.model.mesh import mesh_of_shape
from moejax.model.pipeline import Pipelined
from moejax.model.transformer import Transformer
from moejax.strategy import stages as stage_cost
from moejax.train import step as step_lib
from moejax.train.programs import initial_layout
from tests import hlo
from tests.helpers import TINY_MODEL, TINY_MOE, tokens
from tests.moe_helpers import microbatch_dims, model_lengths, pipeline_reference, stage_setup
from tests.numerics import assert_close, assert_trees_close

# Four layer groups (one MoE layer each) so that four stages get one group each.
FOUR_GROUPS = dataclasses.replace(TINY_MOE, moe_every=1)


@pytest.mark.slow
@pytest.mark.parametrize("stages, shape, micro, moe_cfg", [
    (2, (1, 4, 1), 2, TINY_MOE),
    (2, (2, 2, 1), 2, TINY_MOE),
    (4, (1, 2, 1), 4, FOUR_GROUPS),
], ids=["p2_e4", "p2_d2_e2", "p4_e2"])
def test_pipeline_matches_one_device(stages, shape, micro, moe_cfg):
  ref_loss, ref_grads, ref_counts = pipeline_reference(TINY_MODEL, moe_cfg, micro)
  model, layout, state = stage_setup(TINY_MODEL, moe_cfg, shape, stages)
  assert state.params["layers"]["moe"]["w_gate"].sharding.spec[:2] == ("stage", "expert")
  f = jax.jit(jax.value_and_grad(
      lambda p, b: step_lib.loss_fn(p, Pipelined(model, micro), moe_cfg, b, layout),
      has_aux=True))
  compiled = f.lower(state.params, tokens()).compile()
  (loss, aux), grads = compiled(state.params, tokens())
  sends = hlo.loop_sends(compiled.as_text(), stage_cost.ticks(stages, micro),
                         microbatch_dims(shape, micro))
  assert sends == [stage_cost.SENDS_PER_TICK // 2] * 2, sends   # forward, backward loop
  loss_len, grad_len = model_lengths(TINY_MODEL, moe_cfg)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  assert_close(float(loss), ref_loss, loss_len, err_msg="loss")
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1), ref_counts)
  assert_trees_close(jax.device_get(grads), ref_grads, grad_len)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(jax.device_get(grads))), \
      "every parameter gets a gradient through the pipeline"


@pytest.mark.slow
def test_one_stage_one_microbatch_is_the_transformer():
  """P = 1, M = 1: the pipeline's program computes the Transformer's own head (final hidden
  states, unembedding) and stats."""
  small = dataclasses.replace(TINY_MODEL, num_layers=2)
  moe_cfg = dataclasses.replace(TINY_MOE, moe_every=1)
  mesh = mesh_of_shape((1, 1, 1))
  model = Transformer(small, moe_cfg, mesh)
  layout = initial_layout(moe_cfg, 2, 1)
  params = nn.meta.unbox(model.init(jax.random.key(0), tokens()[:, :-1], layout))["params"]
  want = jax.jit(lambda p, t: model.apply({"params": p}, t, layout))(params, tokens()[:, :-1])
  got = jax.jit(lambda p, t: Pipelined(model, 1).apply({"params": p}, t, layout))(
      params, tokens()[:, :-1])
  assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
