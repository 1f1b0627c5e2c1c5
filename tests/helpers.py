"""Small shared builders for tests: a tiny model on a given mesh shape."""

from __future__ import annotations

import jax

from moejax.config import ModelConfig, MoEConfig, OptimConfig, num_moe_layers
from moejax.model.mesh import mesh_of_shape
from moejax.model.transformer import Transformer
from moejax.train.optim import optimizer
from moejax.train.programs import initial_layout
from moejax.train.state import init_state, state_shardings

TINY_MODEL = ModelConfig(d_model=32, num_layers=4, num_heads=4, d_ff=64, max_seq_len=16)
TINY_MOE = MoEConfig(num_experts=8, top_k=2, capacity_factor=8.0, d_ff=32, moe_every=2)
BATCH, SEQ = 8, 16


def tiny_setup(shape, model_cfg=TINY_MODEL, moe_cfg=TINY_MOE, seed=0):
  """Returns (mesh, model, tx, layout, shardings, state) for a (data, expert, model) shape."""
  mesh = mesh_of_shape(shape)
  model = Transformer(model_cfg, moe_cfg, mesh)
  layout = jax.device_put(
      initial_layout(moe_cfg, num_moe_layers(model_cfg, moe_cfg), shape[1]),
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  tx = optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1), 10)
  shardings = state_shardings(model, tx, mesh, layout, BATCH, SEQ)
  state = init_state(model, tx, shardings, layout, BATCH, SEQ, seed)
  return mesh, model, tx, layout, shardings, state


def tokens(seed=1, vocab=256):
  return jax.random.randint(jax.random.key(seed), (BATCH, SEQ + 1), 0, vocab)
