"""ZeRO-3 (mesh.fsdp): parameters and Adam moments sharded over `data`; the step is unchanged."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from moejax.config import OptimConfig
from moejax.model.mesh import mesh_of_shape, param_rules
from moejax.model.transformer import Transformer
from moejax.train import step as step_lib
from moejax.train.optim import optimizer
from moejax.train.programs import initial_layout
from moejax.train.state import init_state, per_device_bytes, state_shardings
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE, tokens
from tests.moe_helpers import model_lengths
from tests.numerics import assert_close, assert_trees_close

LOSS_LEN, GRAD_LEN = model_lengths()
SHAPE = (2, 4, 1)


def _per_device_bytes(tree) -> int:
  """Bytes one device holds of `tree` (its first device's shards)."""
  dev = jax.devices()[0]
  return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
             if s.device == dev)


def _step_parts(fsdp: bool):
  mesh = mesh_of_shape(SHAPE)
  model = Transformer(TINY_MODEL, TINY_MOE, mesh)
  layout = jax.device_put(initial_layout(TINY_MOE, 2, SHAPE[1]),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  tx = optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1), 10)
  shardings = state_shardings(model, tx, mesh, layout, BATCH, SEQ, param_rules(fsdp=fsdp))
  state = init_state(model, tx, shardings, layout, BATCH, SEQ, 0)
  loss_fn = lambda p, b, lay: step_lib.loss_fn(p, model, TINY_MOE, b, lay)
  f = jax.jit(jax.value_and_grad(loss_fn, has_aux=True),
      in_shardings=(shardings.params, None, None), out_shardings=(None, shardings.params))
  compiled = f.lower(state.params, tokens(), layout).compile()
  (loss, _), grads = compiled(state.params, tokens(), layout)
  return state, float(loss), grads, compiled.as_text()


# Multi-head latent attention's up-projections and latent norms have no embed dim: FSDP
# splits their latent dim instead.
MLA_MODEL = dataclasses.replace(TINY_MODEL, kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=4,
                                qk_rope_head_dim=4, v_head_dim=6)


@pytest.mark.parametrize("model_cfg", [TINY_MODEL, MLA_MODEL], ids=["mha", "mla"])
def test_fsdp_shards_every_state_leaf_over_data(model_cfg):
  """Shapes only (no compile): with FSDP every parameter and Adam moment has its embed dim
  (or MLA's latent dim) over `data`, so on 2x4x1 a device holds half the train state it
  holds without."""
  mesh = mesh_of_shape(SHAPE)
  model = Transformer(model_cfg, TINY_MOE, mesh)
  layout = initial_layout(TINY_MOE, 2, SHAPE[1])
  tx = optimizer(OptimConfig(), 10)
  shapes = jax.eval_shape(lambda: init_state(model, tx, None, layout, BATCH, SEQ, 0))
  per_device = {}
  for fsdp in (False, True):
    sh = state_shardings(model, tx, mesh, layout, BATCH, SEQ, param_rules(fsdp=fsdp))
    per_device[fsdp] = (per_device_bytes(shapes.params, sh.params),
                        per_device_bytes(shapes, sh))
    specs = jax.tree.leaves(jax.tree.map(lambda s: s.spec, sh.params))
    assert all(("data" in tuple(s)) == fsdp for s in specs), specs
  assert per_device[True][0] * 2 == per_device[False][0], per_device     # params
  assert abs(per_device[True][1] / per_device[False][1] - 0.5) < 0.01, per_device  # + Adam


@pytest.mark.slow
def test_fsdp_on_and_off_give_the_same_step():
  """Loss and every gradient equal with and without FSDP; with it, the dense weights, their
  gradients and their Adam moments are split over data (2 devices) on the embed dim."""
  off_state, off_loss, off_grads, off_hlo = _step_parts(False)
  on_state, on_loss, on_grads, on_hlo = _step_parts(True)
  # The partitioner gathers the data-sharded weights: all-gathers only FSDP has.
  assert on_hlo.count("all-gather") > off_hlo.count("all-gather"), "no FSDP all-gathers"
  assert_close(on_loss, off_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(jax.device_get(on_grads), jax.device_get(off_grads), GRAD_LEN)
  wq = on_state.params["layers"]["attn_0"]["wq"]          # [layers, D, heads, hdim]
  assert wq.sharding.spec[1] == "data", wq.sharding.spec
  assert on_grads["layers"]["attn_0"]["wq"].sharding.spec[1] == "data"
  mu = on_state.opt_state[1][0].mu["layers"]["attn_0"]["wq"]
  assert mu.addressable_shards[0].data.shape[1] == TINY_MODEL.d_model // SHAPE[0]
  # Every parameter has an embed dim, so each device holds half of params and moments.
  on_bytes, off_bytes = _per_device_bytes(on_state), _per_device_bytes(off_state)
  assert abs(on_bytes / off_bytes - 0.5) < 0.01, (on_bytes, off_bytes)
