"""Pipeline stages under FSDP (mesh.fsdp): each layer's expert weights are gathered inside the
tick loop, one layer at a time, and the step equals one device's; fsep's stages restore each
layer on its FSDP shards, as one stage does (tests/test_fsep_fsdp.py).

The stage's weights are the same in every tick, so JAX's scan linearization hoists what is
computed from them alone (the bf16 weights, and with them FSDP's gather) out of the tick loop:
one loop over the stage's K layers before the ticks, holding all K layers' gathered weights
for the whole step (DeepSeek-V3 on 256 compile-only H100s, p2: 3 x 101.5 GiB a GPU). The
pipeline ties each layer's weights to its input with a barrier inside the layer's checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from moejax.aot.hlo import parse
from moejax.config import OptimConfig, default_fsep_slots, num_moe_layers
from moejax.model.mesh import mesh_of_shape, param_rules
from moejax.model.pipeline import Pipelined
from moejax.model.transformer import Transformer
from moejax.strategy import stages as stage_cost
from moejax.train import step as step_lib
from moejax.train.optim import optimizer
from moejax.train.programs import initial_layout
from moejax.train.state import init_state, state_shardings
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE, tokens
from tests.hlo import array_dims
from tests.moe_helpers import model_lengths, pipeline_reference
from tests.numerics import assert_close, assert_trees_close

MICRO = 2
# (stages, (data, expert, model)): two stages of data 2 (FSDP's) x expert 2, and microbatches
# alone (one stage, whose tick loop is the microbatches')
CASES = {"p2": (2, (2, 2, 1)), "m2": (1, (2, 2, 1))}
# 4 MoE layers, K = 2 a stage; bf16 as the GPU configs (the hoisted values are its casts)
MODEL = dataclasses.replace(TINY_MODEL, num_layers=8, remat=True, dtype="bfloat16")
F32_MODEL = dataclasses.replace(MODEL, dtype="float32")
# d_ff 48: a layer's stored shards ([E, D, 24] a device) are not shaped like an activation
FSEP_MOE = dataclasses.replace(TINY_MOE, expert_mode="fsep", d_ff=48)


@functools.cache
def _step_parts(model_cfg, case: str = "p2", moe_cfg=TINY_MOE):
  stages, shape = CASES[case]
  mesh = mesh_of_shape(shape, stage=stages)
  model = Transformer(model_cfg, moe_cfg, mesh, fsdp=True)   # as the trainer builds it
  layout = jax.device_put(initial_layout(moe_cfg, num_moe_layers(model_cfg, moe_cfg), shape[1]),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  tx = optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1), 10)
  shardings = state_shardings(model, tx, mesh, layout, BATCH, SEQ,
                              param_rules(fsdp=True, stage=stages > 1))
  state = init_state(model, tx, shardings, layout, BATCH, SEQ, 0)
  experts = state.params.get("fsep_experts") or state.params["layers"]["moe"]
  assert "data" in tuple(experts["w_gate"].sharding.spec)
  loss_fn = lambda p, b: step_lib.loss_fn(p, Pipelined(model, MICRO), moe_cfg, b, layout)
  f = jax.jit(jax.value_and_grad(loss_fn, has_aux=True),
              in_shardings=(shardings.params, None), out_shardings=(None, shardings.params))
  compiled = f.lower(state.params, tokens()).compile()
  (loss, aux), grads = compiled(state.params, tokens())
  return float(loss), aux, grads, compiled.as_text()


def _gathered_expert_dims(model_cfg, expert: int) -> set[tuple[int, ...]]:
  """One layer's expert weights on a device, their embed dim whole: [E/expert, D, F] and
  [E/expert, F, D]."""
  e, d, f = TINY_MOE.num_experts // expert, model_cfg.d_model, TINY_MOE.d_ff
  return {(e, d, f), (e, f, d)}


def _reachable(module, name: str, seen: set) -> set:
  if name in seen or name not in module.computations:
    return seen
  seen.add(name)
  for ins in module.computations[name]:
    for callee in ins.callees:
      _reachable(module, callee, seen)
  return seen


@pytest.mark.parametrize("case", CASES)
def test_each_layer_is_gathered_inside_the_tick_loop(case):
  """Every all-gather of one layer's expert weights runs in a tick loop (forward or
  backward), and no array anywhere holds the stage's K layers of them gathered."""
  stages, shape = CASES[case]
  hlo = _step_parts(MODEL, case)[3]
  module = parse(hlo)
  one_layer = _gathered_expert_dims(MODEL, shape[1])
  in_ticks = _in_tick_loops(module, stage_cost.ticks(stages, MICRO))
  gathers = [(comp, ins) for comp, body in module.computations.items() for ins in body
             if ins.opcode in ("all-gather", "all-gather-start")
             and one_layer & set(array_dims(ins))]
  assert len(gathers) >= 6, "forward and backward gather each of w_gate, w_up, w_down"
  outside = [ins.name for comp, ins in gathers if comp not in in_ticks]
  assert not outside, f"expert weights gathered outside the tick loops: {outside}"
  k = num_moe_layers(MODEL, TINY_MOE) // stages
  stacked = {(k,) + dims for dims in one_layer} | {(k, 1) + dims for dims in one_layer}
  held = {m.group(0) for m in re.finditer(r"\b(?:bf16|f32)\[([\d,]+)\]", hlo)
          if tuple(int(x) for x in m.group(1).split(",")) in stacked}
  assert not held, f"the stage's {k} layers of gathered expert weights held at once: {held}"


@pytest.mark.slow
def test_pipeline_under_fsdp_matches_one_device():
  """Loss, counts and every gradient of the pipelined FSDP step (float32, remat on) equal
  the one-device Transformer's, microbatch by microbatch."""
  ref_loss, ref_grads, ref_counts = pipeline_reference(F32_MODEL, TINY_MOE, MICRO)
  loss, aux, grads, _ = _step_parts(F32_MODEL)
  loss_len, grad_len = model_lengths(F32_MODEL, TINY_MOE)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  assert_close(loss, ref_loss, loss_len, err_msg="loss")
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1), ref_counts)
  assert_trees_close(jax.device_get(grads), ref_grads, grad_len)


def _in_tick_loops(module, ticks: int) -> set:
  """The computations a tick loop (forward or backward: the entry's loops of `ticks`
  iterations) runs."""
  inside: set = set()
  for ins in module.computations[module.entry]:
    if ins.opcode == "while" and ins.trip_count() == ticks:
      _reachable(module, ins.attr("body"), inside)
  return inside


def test_fsep_stages_restore_on_the_shards():
  """fsep under stages and FSDP gathers no stored expert weights: every restore's exchange
  holds 1/data of the embed dim, and the restored layer is gathered whole only where the MoE
  layer takes it, one layer a tick (before, each restore gathered the stored layer's float32
  shards over data and exchanged the whole embed dim)."""
  stages, (data, expert, model) = CASES["p2"]
  hlo = _step_parts(F32_MODEL, "p2", FSEP_MOE)[3]
  module = parse(hlo)
  e, d, f = FSEP_MOE.num_experts, F32_MODEL.d_model, FSEP_MOE.d_ff
  stored = {(e, d, f // (expert * model)), (e, f // (expert * model), d)}   # a layer's shards
  slots = default_fsep_slots(e, expert)
  restored = {(slots, d, f // model), (slots, f // model, d)}               # one layer, whole
  gathers = [(comp, ins) for comp, body in module.computations.items() for ins in body
             if ins.opcode in ("all-gather", "all-gather-start")]
  assert not [ins.name for _, ins in gathers if stored & set(array_dims(ins))], \
      "stored fsep weights gathered before their restore"
  exchanges = [dims for body in module.computations.values() for ins in body
               if ins.opcode in ("all-to-all", "all-to-all-start")
               and "fsep_restore" in ins.op_name for dims in array_dims(ins)]
  assert exchanges, "no fsep_restore all-to-all in the program"
  assert all(d // data in s and d not in s for s in exchanges), exchanges
  whole = [(comp, ins) for comp, ins in gathers if restored & set(array_dims(ins))]
  assert len(whole) >= 6, "forward and backward gather each restored w_gate, w_up, w_down"
  in_ticks = _in_tick_loops(module, stage_cost.ticks(stages, MICRO))
  assert all(comp in in_ticks for comp, _ in whole), \
      [ins.name for comp, ins in whole if comp not in in_ticks]


def test_fsep_under_stages_and_fsdp_matches_one_device():
  """fsep on two stages of data 2 (FSDP's) x expert 2, restoring on the shards: loss, counts
  and every gradient equal the one-device Transformer's, microbatch by microbatch (float32,
  remat on). Shares the program of the restore test above."""
  ref_loss, ref_grads, ref_counts = pipeline_reference(F32_MODEL, FSEP_MOE, MICRO)
  loss, aux, grads, _ = _step_parts(F32_MODEL, "p2", FSEP_MOE)
  loss_len, grad_len = model_lengths(F32_MODEL, FSEP_MOE)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  assert_close(loss, ref_loss, loss_len, err_msg="loss")
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1), ref_counts)
  grads = jax.device_get(grads)
  assert_trees_close(grads, ref_grads, grad_len)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads)), "a parameter got no gradient"
