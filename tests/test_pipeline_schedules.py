"""Pooled capacity, fsep and the circular schedule under pipeline stages equal one device.

As in test_pipeline.py the reference is the unpipelined Transformer on one device, run
microbatch by microbatch (rows i % M == m), losses and gradients averaged. The models have
MoE layers only (moe_every = 1: no dense blocks) to keep the compiles short; each case still
compiles a pipelined program for minutes on this 2-core VM, hence `slow`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from moejax.model import layer_order
from moejax.model.pipeline import Pipelined
from moejax.strategy import stages as stage_cost
from moejax.train import step as step_lib
from tests import hlo
from tests.helpers import TINY_MODEL, TINY_MOE, tokens
from tests.moe_helpers import microbatch_dims, model_lengths, stage_setup
from tests.numerics import assert_close, assert_trees_close

ONLY_MOE = dataclasses.replace(TINY_MOE, moe_every=1)
TWO_LAYERS = dataclasses.replace(TINY_MODEL, num_layers=2)
POOLED = dataclasses.replace(ONLY_MOE, capacity="device")
FSEP = dataclasses.replace(ONLY_MOE, expert_mode="fsep")


@functools.cache
def _reference(model_cfg, moe_cfg, micro):
  """Mean loss and gradients of the one-device Transformer over the microbatches."""
  model, layout, state = stage_setup(model_cfg, moe_cfg, (1, 1, 1))
  params = state.params
  f = jax.jit(jax.value_and_grad(
      lambda p, b: step_lib.loss_fn(p, model, moe_cfg, b, layout), has_aux=True))
  outs = [f(params, tokens()[m::micro]) for m in range(micro)]
  loss = np.mean([float(loss) for (loss, _), _ in outs])
  grads = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *[g for _, g in outs])
  counts = sum(np.asarray(aux["counts_LxWxE"]).sum(1) for (_, aux), _ in outs)
  return loss, jax.device_get(grads), counts


def _check_pipeline(model_cfg, moe_cfg, shape, stages, micro, virtual=1):
  ref_loss, ref_grads, ref_counts = _reference(model_cfg, moe_cfg, micro)
  model, layout, state = stage_setup(model_cfg, moe_cfg, shape, stages)
  params = state.params
  piped = Pipelined(model, micro, virtual)
  order = piped.layer_order
  stored = jax.jit(lambda p: layer_order.params_to(p, order))(params)   # circular storage
  f = jax.jit(jax.value_and_grad(
      lambda p, b: step_lib.loss_fn(p, piped, moe_cfg, b, layout), has_aux=True))
  compiled = f.lower(stored, tokens()).compile()
  (loss, aux), grads = compiled(stored, tokens())
  # One send per tick each way (the rotation and its transpose), circular as GPipe.
  sends = hlo.loop_sends(compiled.as_text(), stage_cost.ticks(stages, micro, virtual),
                         microbatch_dims(shape, micro))
  assert sends == [stage_cost.SENDS_PER_TICK // 2] * 2, sends
  grads = layer_order.params_to(jax.device_get(grads), layer_order.inverse(order))
  loss_len, grad_len = model_lengths(model_cfg, moe_cfg)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  assert_close(float(loss), ref_loss, loss_len, err_msg="loss")
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1), ref_counts)
  assert_trees_close(grads, ref_grads, grad_len)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads)), \
      "every parameter gets a gradient through the pipeline"


@pytest.mark.slow
@pytest.mark.parametrize("moe_cfg", [POOLED, FSEP], ids=["pooled", "fsep"])
def test_p2_e4_matches_one_device(moe_cfg):
  """P=2 x expert=4 with pooled capacity (the default job's) and with fsep experts."""
  _check_pipeline(TWO_LAYERS, moe_cfg, (1, 4, 1), stages=2, micro=2)


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [1, 2], ids=["gpipe", "circular"])
def test_gpipe_and_circular_match_one_device(virtual):
  """P=2 x expert=2, four MoE layers: GPipe (2 per stage) and circular (V=2 chunks of one
  per stage: stage 0 holds layers 0 and 2) give one device's loss and gradients."""
  _check_pipeline(TINY_MODEL, ONLY_MOE, (1, 2, 1), stages=2, micro=2, virtual=virtual)
