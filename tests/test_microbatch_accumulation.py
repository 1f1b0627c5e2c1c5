"""Microbatches on one stage: the train step's loop that adds each microbatch's gradients in
place (moejax.train.step.accumulated_loss_and_grads) gives the one-stage pipeline's loss,
counts and every gradient, and its compiled program has no zero-filled stack of layer
gradients per microbatch."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moejax.model.pipeline import Pipelined
from moejax.train import step as step_lib
from tests.helpers import TINY_MODEL, TINY_MOE, tokens
from tests.moe_helpers import model_lengths, pipeline_reference, stage_setup
from tests.numerics import assert_close, assert_trees_close


def _accumulated(shape, micro):
  model, layout, state = stage_setup(TINY_MODEL, TINY_MOE, shape)
  f = jax.jit(lambda p, b: step_lib.accumulated_loss_and_grads(p, model, TINY_MOE, b, layout,
                                                               micro))
  (loss, aux), grads = f(state.params, tokens())
  return float(loss), aux, jax.device_get(grads)


def _check(got, want):
  (loss, aux, grads), (ref_loss, ref_grads, ref_counts) = got, want
  loss_len, grad_len = model_lengths(TINY_MODEL, TINY_MOE)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  assert_close(loss, ref_loss, loss_len, err_msg="loss")
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1), ref_counts)
  assert_trees_close(grads, ref_grads, grad_len)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads)), \
      "every parameter gets a gradient through the loop"


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 1)], ids=["one_device", "d2_e2"])
def test_accumulated_matches_the_microbatch_by_microbatch_reference(shape):
  """The mean loss, summed counts and mean gradients of the Transformer run microbatch by
  microbatch (rows i % M == m), on one device and on a data x expert mesh."""
  _check(_accumulated(shape, 2), pipeline_reference(TINY_MODEL, TINY_MOE, 2))


@pytest.mark.slow   # the one-stage pipeline's program compiles slowly on this 2-core VM
def test_accumulated_equals_the_one_stage_pipeline():
  """The path it replaced: the pipeline of one stage over two microbatches, differentiated."""
  shape, micro = (2, 2, 1), 2
  model, layout, state = stage_setup(TINY_MODEL, TINY_MOE, shape)
  f = jax.jit(jax.value_and_grad(
      lambda p, b: step_lib.loss_fn(p, Pipelined(model, micro), TINY_MOE, b, layout),
      has_aux=True))
  (loss, aux), grads = f(state.params, tokens())
  counts = np.asarray(aux["counts_LxWxE"]).sum(1)
  _check(_accumulated(shape, micro), (float(loss), jax.device_get(grads), counts))


def _squeezed(dims) -> tuple:
  return tuple(d for d in dims if d != 1)


def _layer_grad_fills(compiled_text: str, stacked_shapes: set) -> float:
  """Zero or constant fills that run more than once a step (inside a loop) and write an f32
  array of a stacked layer parameter's shape (size-1 axes aside: the pipeline's stage and chunk
  axes): a layer-gradient stack filled per microbatch."""
  from moejax.aot import work
  from moejax.aot.hlo import parse
  from moejax.aot.profile import kernels_by_instruction
  module = parse(compiled_text)
  found = 0.0
  for ins, _, runs, _ in kernels_by_instruction(module):
    if runs > 1 and work.memory_kind(module, ins) == "fill":
      found += runs * sum(dtype == "f32" and _squeezed(dims) in stacked_shapes
                          for dtype, dims in ins.arrays())
  return found


def test_compiled_step_fills_no_layer_gradient_stack_per_microbatch():
  """The Mixtral-shaped benchmark config, tiny, at two microbatches, compiled for one
  compile-only H200 (the `gpu_aot` extra): the one-stage pipeline's backward fills a stack of
  every layer's gradients with zeros once per microbatch; the loop adds into the gradient
  buffers in place and fills none."""
  from benchmarks.gpu.gpu_train_step import PATHS, load_config, with_bindings
  from moejax.aot import gpus
  from moejax.aot.compile import xla_options
  from moejax.strategy.spec import from_config
  from moejax.train.optim import optimizer, schedule
  from moejax.train.programs import build_program
  if why := gpus.has_cuda_plugin():
    pytest.skip(why)
  micro = 2
  cfg = with_bindings(load_config(True, 1, "mixtral_2l"), {**dict(PATHS)["dense/xla"],
                                                                "train.microbatches": micro})
  tx, lr = optimizer(cfg.optim, 10), schedule(cfg.optim, 10)
  prog = build_program(cfg, from_config(cfg, 1), tx, lr, gpus.compile_only_devices("h200",
                       "1x1x1"), compile_now=False)
  model, cfg = prog.model, prog.cfg
  params = prog.abstract_state(tx).params
  batch = jax.ShapeDtypeStruct((cfg.data.global_batch_size, cfg.data.seq_len + 1), "int32",
                               sharding=prog.batch_sharding)
  stacked = {_squeezed(a.shape) for a in jax.tree.leaves(params["layers"]) if a.ndim > 1}

  def pipelined(p, b, layout):
    return jax.value_and_grad(step_lib.loss_fn, has_aux=True)(
        p, Pipelined(model, micro), cfg.moe, b, layout)

  def accumulated(p, b, layout):
    return step_lib.accumulated_loss_and_grads(p, model, cfg.moe, b, layout, micro)

  fills = {f.__name__: _layer_grad_fills(jax.jit(f).lower(
               params, batch, prog.abstract_layout()).compile(
                   compiler_options=xla_options()).as_text(), stacked)
           for f in (pipelined, accumulated)}
  assert fills["pipelined"] > 0 and fills["accumulated"] == 0, fills


def test_eval_over_microbatches_is_the_batch_cross_entropy():
  """eval_step a microbatch at a time: the mean of equal microbatches' means is the batch's
  (capacity is per microbatch; this one drops nothing either way)."""
  model, layout, state = stage_setup(TINY_MODEL, TINY_MOE, (1, 1, 1))
  ce = {m: float(jax.jit(lambda p, b, m=m: step_lib.eval_step(
      p, b, layout, model=model, moe_cfg=TINY_MOE, microbatches=m))(state.params, tokens()))
        for m in (1, 2)}
  loss_len, _ = model_lengths(TINY_MODEL, TINY_MOE)
  assert_close(ce[2], ce[1], loss_len, err_msg="cross-entropy")
