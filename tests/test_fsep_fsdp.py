"""fsep under FSDP (mesh.fsdp): each layer's restore gathers that layer's stored shards only,
and the step equals fsep without FSDP.

FSDP shards the stored fsep weights' embed dim over `data`, which the restore does not take;
the gather of the one layer the scanned group restores must follow its slice. Left to
propagate, XLA's SPMD partitioner gathered the whole [layers, E, ...] stack in every layer
iteration (Mixtral-8x7B on 64 compile-only H100s: 8.5 GB an all-gather, 15.9 s of a 21 s step
in the schedule estimate).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import pytest

from moejax.config import OptimConfig
from moejax.model.mesh import mesh_of_shape, param_rules
from moejax.model.transformer import Transformer
from moejax.train import step as step_lib
from moejax.train.optim import optimizer
from moejax.train.programs import initial_layout
from moejax.train.state import init_state, state_shardings
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE, tokens
from tests.moe_helpers import model_lengths
from tests.numerics import assert_close, assert_trees_close

LOSS_LEN, GRAD_LEN = model_lengths()
SHAPE = (2, 4, 1)
MODEL = dataclasses.replace(TINY_MODEL, num_layers=8)          # 4 MoE layers
MOE = dataclasses.replace(TINY_MOE, expert_mode="fsep")


@functools.cache
def _step_parts(fsdp: bool):
  mesh = mesh_of_shape(SHAPE)
  model = Transformer(MODEL, MOE, mesh)
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
  (loss, _), grads = compiled(state.params, tokens(), layout)
  return float(loss), grads, compiled.as_text()


def test_each_restore_gathers_one_layer():
  """Every all-gather of stored fsep weights ([layers, E, D, ffn] or [layers, E, ffn, D],
  f32) holds one layer, inside the layer loop and out."""
  hlo = _step_parts(True)[2]
  e, d = MOE.num_experts, MODEL.d_model
  shapes = [tuple(int(x) for x in m.group(1).split(","))
            for m in re.finditer(r"= f32\[([\d,]+)\][^=]*? all-gather(?:-start)?\(", hlo)]
  stored = [s for s in shapes if len(s) == 4 and s[1] == e and d in s[2:]]
  assert stored, "no all-gather of the stored fsep weights under FSDP"
  assert all(s[0] == 1 for s in stored), stored


@pytest.mark.slow
def test_fsdp_on_and_off_give_the_same_fsep_step():
  (off_loss, off_grads, _), (on_loss, on_grads, _) = _step_parts(False), _step_parts(True)
  assert_close(on_loss, off_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(jax.device_get(on_grads), jax.device_get(off_grads), GRAD_LEN)
