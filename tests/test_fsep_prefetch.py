"""FSEP restores layer by layer: the layer scan restores layer l+1 in the iteration that
computes layer l, in the compute dtype, and the backward pass restores each layer again
instead of keeping every layer's restored weights.

The program properties are read from the compiled (optimised) HLO and XLA's memory analysis
of a bfloat16 fsep model's loss-and-grad on the (2, 4, 1) mesh, one MoE block per scan step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.aot.hlo import parse
from moejax.config import MoEConfig
from moejax.layout.tables import from_placements
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.fsep_experts import restore_slot_weights
from moejax.model.moe.harness import objective
from moejax.model.moe.layer import moe_apply
from moejax.model.transformer import Transformer
from moejax.train import step as step_lib
from moejax.train.programs import initial_layout
from moejax.train.state import abstract, state_shardings
from tests import hlo as hlo_lib
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE, tokens
from tests.moe_helpers import (
  FSEP_MOE,
  GRAD_LEN,
  LOSS_LEN,
  SMALL_MODEL,
  Y_LEN,
  D,
  E,
  F,
  fsep_loss_and_grad,
  make_params,
  random_placement,
)
from tests.numerics import assert_close, assert_trees_close

SHAPE, SLOTS = (2, 4, 1), 4
WIDE_F, NARROW_F = 512, 64        # expert FFN widths of the memory comparison
EPS_BF16 = 2.0 ** -8


@functools.cache
def _compiled(layers: int, d_ff: int):
  """(compiled loss-and-grad, its jitted function, abstract params, layout) of a bf16 fsep
  model with `layers` MoE layers (one per scan step) of expert width `d_ff`; nothing is
  initialised or run."""
  model_cfg = dataclasses.replace(TINY_MODEL, num_layers=layers, dtype="bfloat16")
  moe = dataclasses.replace(TINY_MOE, moe_every=1, d_ff=d_ff, expert_mode="fsep",
                            slots_per_device=SLOTS)
  mesh = mesh_of_shape(SHAPE)
  model = Transformer(model_cfg, moe, mesh)
  layout = jax.device_put(initial_layout(moe, layers, SHAPE[1]), NamedSharding(mesh, P()))
  shardings = state_shardings(model, optax.sgd(1.0), mesh, layout, BATCH, SEQ)
  shapes = jax.eval_shape(lambda: nn.meta.unbox(model.init(
      jax.random.key(0), jnp.zeros((BATCH, SEQ), jnp.int32), layout))["params"])
  params = abstract(shapes, shardings.params)
  f = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=moe), has_aux=True))
  return f.lower(params, batch_BxQ1=tokens(), layout=layout).compile(), f, params, layout


def _is_compute(module, ins) -> bool:
  """A matmul (direct or fused) or a token exchange: this iteration's layer compute."""
  if ins.opcode in ("dot", "convolution"):
    return True
  if ins.opcode == "all-to-all":
    return "fsep_restore" not in ins.line
  return any(hlo_lib.has_dot(module, c) for c in ins.callees)


def _while_bodies(module) -> tuple[str, str]:
  """Body computations of the forward and the backward (transposed) layer loop."""
  loops = [ins for ins in module.computations[module.entry] if ins.opcode == "while"]
  forward = [ins.attr("body") for ins in loops if "transpose(" not in ins.line]
  backward = [ins.attr("body") for ins in loops if "transpose(" in ins.line]
  assert len(forward) == 1 and len(backward) == 1, [ins.line for ins in loops]
  return forward[0], backward[0]


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_next_layers_restore_does_not_wait_for_this_layers_compute():
  """In the compiled loss-and-grad of an 8-MoE-layer bf16 fsep model, the forward loop body
  restores (all_to_all, named `fsep_restore`) the next layer's weights, and no such exchange
  depends, through its operands, on a matmul or a token all_to_all of the same iteration:
  XLA may run it while this layer computes. Likewise in the backward loop body, whose
  weight exchanges send layer l+1's gradient home (the prefetch's transpose) and restore
  layer l again. Under the old program (every restore before the loop) the loop bodies held
  no restore at all. Every weight exchange moves bf16 in the lowered program (XLA:CPU widens
  bf16 all_to_alls to f32 when it optimises, so the dtype is read before that)."""
  compiled, f, params, layout = _compiled(8, NARROW_F)
  lowered = f.lower(params, batch_BxQ1=tokens(), layout=layout).as_text()
  weight_a2a = re.findall(r'"stablehlo.all_to_all"\(%\w+\) .*?: \(tensor<1x(\w+)>\)', lowered)
  assert len(weight_a2a) >= 9 and all(t.endswith("xbf16") for t in weight_a2a), weight_a2a
  module = parse(compiled.as_text())
  for loop, body_name in zip(("forward", "backward"), _while_bodies(module)):
    body = module.by_name(body_name)
    restores = [n for n, ins in body.items()
                if ins.opcode == "all-to-all" and "fsep_restore" in ins.line]
    assert len(restores) >= (1 if loop == "forward" else 2), f"{loop} loop: {restores}"
    assert any(_is_compute(module, ins) and "all-to-all" in ins.line for ins in body.values()), \
        f"expected the token all_to_alls inside the {loop} layer loop"
    assert any(ins.opcode != "all-to-all" and _is_compute(module, ins)
               for ins in body.values()), f"expected matmuls inside the {loop} layer loop"
    for name in restores:
      waits_for = hlo_lib.depends_on(body, name, lambda ins: _is_compute(module, ins))
      assert waits_for is None, f"{loop}: {name} waits for {waits_for.line}"


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_restored_weights_held_do_not_grow_with_depth():
  """XLA's compiled memory analysis (temp bytes) of the bf16 fsep loss-and-grad, 2 and 8 MoE
  layers, each at expert widths F = 512 and F = 64. Subtracting the F = 64 growth removes
  every per-layer cost that does not scale with F (attention, tokens, routing), so what is
  left, the F-proportional growth from 2 to 8 layers, is what the program keeps per layer of
  expert weights and expert hidden activations. The old program (every restore before the
  loop, fp32, all kept for the backward pass) grew by ~12 restored layers (bf16 bytes) per
  extra layer here; keeping each layer's bf16 restored weights for its backward pass would
  still add one per extra layer. Restored layer by layer, with the backward pass restoring
  and recomputing each MoE layer, about two layers are live (the one computing and the
  prefetch) whatever the depth; what still grows is the stored shards' fp32 gradient, part of
  which XLA:CPU copies (~0.4 restored layer per extra layer here). Bound: half a restored
  layer per extra layer."""
  temp = {(n, f): _compiled(n, f)[0].memory_analysis().temp_size_in_bytes
          for n in (2, 8) for f in (NARROW_F, WIDE_F)}
  growth = {f: temp[8, f] - temp[2, f] for f in (NARROW_F, WIDE_F)}
  layer_bytes = SLOTS * 3 * TINY_MODEL.d_model * (WIDE_F - NARROW_F) * 2   # bf16, per device
  per_layer = (growth[WIDE_F] - growth[NARROW_F]) / 6 / layer_bytes
  assert per_layer <= 0.5, (temp, per_layer)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_bf16_restore_equals_fp32_restore():
  """The restore in bf16 (cast before the exchange) gives the fp32 restore rounded to bf16,
  and the MoE layer on it (computing in fp32) the fp32 layer's outputs and gradients within
  bf16 tolerance, on the (2, 4, 1) mesh with replicas."""
  mesh = mesh_of_shape(SHAPE)
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=float(4 * SLOTS), d_ff=F,
                  expert_mode="fsep")
  layout = jax.device_put(
      from_placements([random_placement(np.random.default_rng(1), 4, SLOTS)], E, 4),
      NamedSharding(mesh, P()))

  def run(dtype):
    def f(p, x):
      stored = {k: p[k][None] for k in ("w_gate", "w_up", "w_down")}
      slot = restore_slot_weights(stored, layout.slot_expert_LxS, mesh, dtype)
      params = {"router": p["router"], **{k: v[0] for k, v in slot.items()}}
      y, st = moe_apply(params, x, jax.tree.map(lambda a: a[0], layout), cfg, mesh)
      return objective(y, st.balance_loss, st.z_loss), (y, slot)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        make_params(3), jax.random.normal(jax.random.key(4), (8, 8, D)))

  (loss16, (y16, slot16)), grads16 = run(jnp.bfloat16)
  (loss32, (y32, slot32)), grads32 = run(jnp.float32)
  for k in slot32:
    assert slot16[k].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(slot16[k]),
                                  np.asarray(slot32[k].astype(jnp.bfloat16)))
  assert_close(y16, y32, Y_LEN, eps=EPS_BF16, err_msg="y")
  assert_close(loss16, loss32, LOSS_LEN, eps=EPS_BF16, err_msg="loss")
  assert_trees_close(grads16, grads32, GRAD_LEN, eps=EPS_BF16)


def test_remat_keeps_two_bf16_activations_a_layer():
  """Under remat a bf16 fsep layer group keeps, for its backward pass, what is one [B, Q, D]
  bf16 array a layer in the layer scan's residuals: its input and its MoE layer's input
  (the MoE layer recomputes itself in its own backward pass). Checkpointed part by part, the
  group also kept its norms' float32 inputs and outputs: four more [B, Q, D] arrays, in
  float32 (Mixtral-8x7B on 64 compile-only H100s: 0.84 GB a layer of a GPU's 80 GB)."""
  layers = 3
  model_cfg = dataclasses.replace(TINY_MODEL, num_layers=layers, dtype="bfloat16", remat=True)
  moe = dataclasses.replace(TINY_MOE, moe_every=1, expert_mode="fsep", slots_per_device=SLOTS)
  model = Transformer(model_cfg, moe, mesh_of_shape(SHAPE))
  layout = initial_layout(moe, layers, SHAPE[1])
  params = jax.eval_shape(lambda: nn.meta.unbox(model.init(
      jax.random.key(0), jnp.zeros((BATCH, SEQ), jnp.int32), layout))["params"])
  loss = lambda p: step_lib.loss_fn(p, batch_BxQ1=tokens(), layout=layout, model=model,
                                    moe_cfg=moe)[0]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    jax.ad_checkpoint.print_saved_residuals(loss, params)
  per_layer = re.findall(rf"^(\w+)\[{layers},{BATCH},{SEQ},\d+\]", printed.getvalue(), re.M)
  assert per_layer == ["bf16", "bf16"], printed.getvalue()


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_fsep_remat_equals_no_remat():
  """Under remat, fsep checkpoints the part of each layer group before its MoE layer (the
  MoE layer recomputes in its own backward pass): loss and gradients equal the
  unrematerialised model's (the whole-model fsep test's program and params, shared)."""
  f, params, layout = fsep_loss_and_grad(SHAPE, SLOTS)
  model = Transformer(dataclasses.replace(SMALL_MODEL, remat=True), FSEP_MOE,
                      mesh_of_shape(SHAPE))
  f_remat = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=FSEP_MOE), has_aux=True))
  (ref_loss, _), ref_grads = f(params, batch_BxQ1=tokens(), layout=layout)
  (loss, _), grads = f_remat(params, batch_BxQ1=tokens(), layout=layout)
  assert_close(loss, ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(jax.device_get(grads), jax.device_get(ref_grads), GRAD_LEN)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_backward_prefetch_equals_plain_autodiff(monkeypatch):
  """The backward pass's weights come through the layer scan's cotangent channel, restored
  one layer ahead (moejax.model.moe.fsep_backward: `_prefetching_moe`, `close_channel`):
  loss and gradients equal plain autodiff through the forward's restored weights (both
  replaced by identities), on the whole-model test's program and params."""
  from moejax.model.moe import fsep_backward

  f, params, layout = fsep_loss_and_grad(SHAPE, SLOTS)
  (ref_loss, _), ref_grads = f(params, batch_BxQ1=tokens(), layout=layout)
  monkeypatch.setattr(fsep_backward, "_prefetching_moe", lambda moe, fsdp, keeps: (
      lambda mdl, x, layout, weights, channel, *rest: (mdl(x, layout, weights), channel)))
  monkeypatch.setattr(fsep_backward, "_seed_backward_restore", lambda mesh, dtype, fsdp: (
      lambda x, *rest: x))
  model = Transformer(SMALL_MODEL, FSEP_MOE, mesh_of_shape(SHAPE))
  plain = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=FSEP_MOE), has_aux=True))
  (loss, _), grads = plain(params, batch_BxQ1=tokens(), layout=layout)
  assert_close(loss, ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(jax.device_get(grads), jax.device_get(ref_grads), GRAD_LEN)
