"""fsep under FSDP (mesh.fsdp): the restore keeps the stored weights' embed shards, and the
step equals fsep on one device (and fsep without FSDP).

FSDP shards the stored fsep weights' embed dim over `data`. A model told so (Transformer's
`fsdp`) restores each layer from its shards as they lie, exchanging 1/data of each slot, and
gathers the restored compute-dtype weights where the MoE layer takes them. One that is not
gathers the one layer the scanned group restores, following its slice; left to propagate,
XLA's SPMD partitioner gathered the whole [layers, E, ...] stack in every layer iteration
(Mixtral-8x7B on 64 compile-only H100s: 8.5 GB an all-gather, 15.9 s of a 21 s step in the
schedule estimate). The memory model (moejax.strategy.memory) counts the restored layers on
the shards, as the program holds them.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from moejax.config import OptimConfig
from moejax.model.mesh import mesh_of_shape, param_rules
from moejax.model.transformer import Transformer
from moejax.train import step as step_lib
from moejax.train.optim import optimizer
from moejax.train.programs import initial_layout
from moejax.train.state import init_state, state_shardings
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE, tiny_setup, tokens
from tests.moe_helpers import model_lengths
from tests.numerics import assert_close, assert_trees_close

SHAPE = (2, 4, 1)
MODEL = dataclasses.replace(TINY_MODEL, num_layers=8)          # 4 MoE layers
MOE = dataclasses.replace(TINY_MOE, expert_mode="fsep")
LOSS_LEN, GRAD_LEN = model_lengths(MODEL, MOE)


@functools.cache
def _step_parts(fsdp: bool, model_knows: bool = False):
  """(loss, grads, aux, compiled HLO) of the fsep step with its params FSDP-sharded or not,
  the model told so (`model_knows`) or not."""
  mesh = mesh_of_shape(SHAPE)
  model = Transformer(MODEL, MOE, mesh, fsdp and model_knows)
  layers = MODEL.num_layers // MOE.moe_every
  layout = jax.device_put(initial_layout(MOE, layers, SHAPE[1]),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  tx = optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1), 10)
  shardings = state_shardings(model, tx, mesh, layout, BATCH, SEQ, param_rules(fsdp=fsdp))
  state = init_state(model, tx, shardings, layout, BATCH, SEQ, 0)
  loss_fn = lambda p, b, lay: step_lib.loss_fn(p, model, MOE, b, lay)
  f = jax.jit(jax.value_and_grad(loss_fn, has_aux=True),
              in_shardings=(shardings.params, None, None), out_shardings=(None, shardings.params))
  compiled = f.lower(state.params, tokens(), layout).compile()
  (loss, aux), grads = compiled(state.params, tokens(), layout)
  return float(loss), grads, jax.device_get(aux), compiled.as_text()


@functools.cache
def _one_device():
  """(loss, grads, aux) of the same fsep model on one device (every expert's one slot there),
  the same parameters (init_state's seed 0)."""
  _, model, _, layout, _, state = tiny_setup((1, 1, 1), MODEL, MOE)
  f = jax.jit(jax.value_and_grad(
      lambda p, b, lay: step_lib.loss_fn(p, model, MOE, b, lay), has_aux=True))
  (loss, aux), grads = f(state.params, tokens(), layout)
  return float(loss), jax.device_get(grads), jax.device_get(aux)


def _stored_gathers(hlo: str) -> list[tuple[int, ...]]:
  """Shapes of the all-gathers of stored fsep weights ([layers, E, D, ffn] or [layers, E,
  ffn, D], f32)."""
  e, d = MOE.num_experts, MODEL.d_model
  shapes = [tuple(int(x) for x in m.group(1).split(","))
            for m in re.finditer(r"= f32\[([\d,]+)\][^=]*? all-gather(?:-start)?\(", hlo)]
  return [s for s in shapes if len(s) == 4 and s[1] == e and d in s[2:]]


def test_each_restore_gathers_one_layer():
  """A model not told of FSDP: every all-gather of stored fsep weights holds one layer,
  inside the layer loop and out."""
  stored = _stored_gathers(_step_parts(True)[3])
  assert stored, "no all-gather of the stored fsep weights under FSDP"
  assert all(s[0] == 1 for s in stored), stored


def test_restore_exchanges_the_embed_shards():
  """A model told of FSDP gathers no stored weights, and every restore's exchange holds
  1/data of the embed dim (Mixtral-8x7B on 64 compile-only H100s: a layer's estimate 0.162 ->
  0.143 s, the float32 gather of every expert's shard and 8 times the exchange gone)."""
  hlo = _step_parts(True, model_knows=True)[3]
  assert not _stored_gathers(hlo), _stored_gathers(hlo)
  d, d_shard = MODEL.d_model, MODEL.d_model // SHAPE[0]
  exchanges = [tuple(int(x) for x in m.group(1).split(",")) for m in re.finditer(
      r"= \(?\w+\[([\d,]+)\][^=]*? all-to-all(?:-start)?\(.*fsep_restore", hlo)]
  assert exchanges, "no fsep_restore all-to-all in the program"
  assert all(d_shard in s and d not in s for s in exchanges), exchanges


def test_cost_model_restores_what_the_program_exchanges():
  """The step-time model's restore volume (moejax.strategy.cost.restore_bytes) is what each
  compiled restore exchanges: w_gate, w_up and w_down of a device's slots, in the compute
  dtype, 1/data of the embed dim under FSDP."""
  from moejax.aot.hlo import parse
  from moejax.config import Config, DataConfig, MeshConfig
  from moejax.strategy import cost, offline, spec

  cfg = Config(mesh=MeshConfig(*SHAPE, fsdp=True, host_device_count=8), model=MODEL, moe=MOE,
               data=DataConfig(seq_len=SEQ, global_batch_size=BATCH))
  strategy, work = spec.from_config(cfg, 8), offline.workload_of(cfg)
  module = parse(_step_parts(True, model_knows=True)[3])
  exchanged = {ins.bytes() for comp in module.computations.values() for ins in comp
               if ins.opcode in ("all-to-all", "all-to-all-start") and "fsep_restore" in ins.line}
  assert exchanged == {cost.restore_bytes(strategy, work) / 3}, (exchanged, strategy.spec)
  whole = dataclasses.replace(strategy, fsdp=False)
  assert cost.restore_bytes(whole, work) == SHAPE[0] * cost.restore_bytes(strategy, work)


@pytest.mark.parametrize("model_knows", [False, True], ids=["gathered", "restored_on_shards"])
def test_fsep_under_fsdp_matches_one_device(model_knows):
  """fsep with FSDP on (2, 4, 1) (the embed dim of every parameter over data = 2, 4 slots a
  device, replicas) gives the one-device step's loss, expert counts and every gradient (the
  FSDP-sharded gradients gathered), the model told of FSDP (restores on the shards, as the
  trainer builds it) or not (each restore gathers its layer). Shares the HLO tests' programs:
  this tier pays for the one-device reference only."""
  ref_loss, ref_grads, ref_aux = _one_device()
  loss, grads, aux, _ = _step_parts(True, model_knows)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  np.testing.assert_array_equal(aux["counts_LxWxE"].sum(1), ref_aux["counts_LxWxE"].sum(1))
  assert_close(loss, ref_loss, LOSS_LEN, err_msg="loss")
  grads = jax.device_get(grads)
  assert_trees_close(grads, ref_grads, GRAD_LEN)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads)), "a parameter got no gradient"


@pytest.mark.slow
@pytest.mark.parametrize("model_knows", [False, True])
def test_fsdp_on_and_off_give_the_same_fsep_step(model_knows):
  (off_loss, off_grads, _, _), (on_loss, on_grads, _, _) = (_step_parts(False),
                                                            _step_parts(True, model_knows))
  assert_close(on_loss, off_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(jax.device_get(on_grads), jax.device_get(off_grads), GRAD_LEN)


# configs/gpt_moe_gpu.gin's fsep (dense dispatch, XLA's kernels) on 8 compile-only H100s with
# FSDP, experts four times as wide (moe.d_ff 6144) so that the restored layers weigh in the
# peak. XLA's peak a GPU, in a layer group's backward, holds the restore's buffers at 1/data of
# a layer each (and at most a third of one gathered layer's gradient): data 2 x expert 4
# 9.54 GiB, the model 9.91 (+4%); data 4 x expert 2 9.32 GiB, the model 9.77 (+5%). Counting
# the restored layers whole, the model said 10.75 (+13%) and 12.72 (+37%).
WIDE = "moe.d_ff = 6144"


@pytest.mark.slow   # about a minute each to compile on the loaded 2-core VM
@pytest.mark.parametrize("expert", [4, 2], ids=["data2", "data4"])
def test_memory_model_within_ten_percent_of_xla(expert):
  """As tests/test_gpu_program.py's families: the arithmetic memory model within 10% of the
  compiled program's peak."""
  from benchmarks.gpu.gpu_program import family_config, model_predictions
  from moejax.aot import compile_train_step, gpus
  from moejax.aot.summary import peak_bytes

  if why := gpus.has_cuda_plugin():
    pytest.skip(why)
  cfg = family_config("fsep_planned", "1x1x8", [f"mesh.expert = {expert}", "mesh.fsdp = True",
                                                 WIDE])
  gp = compile_train_step(cfg, gpu="h100", topology="1x1x8")
  assert gp.program.strategy.fsdp and gp.program.strategy.expert_mode == "fsep"
  predicted = model_predictions(gp.program.cfg, gp.program.strategy,
                                "h100_node")["model_memory_bytes"]
  xla = peak_bytes(gp.memory)
  assert abs(predicted / xla - 1) <= 0.10, (predicted, xla)
