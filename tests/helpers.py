"""Small shared builders for tests: a tiny model on a given mesh shape, a directory's safetensors
tensors, a subprocess's own stderr lines."""

from __future__ import annotations

import os
import re

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


def safetensors_tensors(directory, framework="np"):
  """Every tensor of a directory's safetensors shards, by name (numpy, or torch's "pt" where
  numpy has no dtype for them: bf16, float8)."""
  from safetensors import safe_open

  out = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(directory, name), framework=framework) as f:
        out.update({k: f.get_tensor(k) for k in f.keys()})
  return out


# What XLA's C++ logging prints at JAX's start-up where its CUDA plugin is installed on a
# host without a GPU ("Could not find cuda drivers"), JAX_PLATFORMS=cpu or not: not ours.
_XLA_LOG = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|[IWE]\d{4} )")


def our_stderr_lines(stderr: str) -> list[str]:
  """A subprocess's non-blank stderr lines without XLA's start-up log."""
  return [line for line in stderr.splitlines() if line.strip() and not _XLA_LOG.match(line)]
