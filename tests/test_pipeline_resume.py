"""Checkpoints across mesh.stage and mesh.fsdp: the parameter tree is the same for every P and
with or without FSDP, so a checkpoint saved by one reads into the other's shardings."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moejax.config import CheckpointConfig, OptimConfig
from moejax.model.mesh import mesh_of_shape, param_rules
from moejax.model.transformer import Transformer
from moejax.train.checkpoint import Checkpointer
from moejax.train.optim import optimizer
from moejax.train.programs import initial_layout
from moejax.train.state import init_state, state_shardings
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE


def _state(shape, stages, fsdp, seed):
  mesh = mesh_of_shape(shape, stage=stages)
  model = Transformer(TINY_MODEL, TINY_MOE, mesh)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  layout = jax.device_put(initial_layout(TINY_MOE, 2, shape[1]), rep)
  tx = optimizer(OptimConfig(), 10)
  sh = state_shardings(model, tx, mesh, layout, BATCH, SEQ, param_rules(fsdp, stages > 1))
  return init_state(model, tx, sh, layout, BATCH, SEQ, seed), layout


@pytest.mark.slow
@pytest.mark.parametrize("src, dst", [
    (((1, 4, 1), 2, True), ((2, 4, 1), 1, False)),     # P=2 + FSDP -> P=1, FSDP off
    (((2, 4, 1), 1, False), ((1, 4, 1), 2, False)),    # and back to P=2
], ids=["p2_fsdp_to_p1", "p1_to_p2"])
def test_checkpoint_moves_across_stages_and_fsdp(tmp_path, src, dst):
  saved, layout = _state(*src, seed=0)
  ckpt = Checkpointer(str(tmp_path), CheckpointConfig())
  ckpt.save(3, saved, layout, {"data_position": 0})
  ckpt.wait()
  target, target_layout = _state(*dst, seed=1)
  restored = ckpt.restore(target, target_layout)
  ckpt.close()
  assert restored.step == 3
  for got, want, like in zip(jax.tree.leaves(restored.state), jax.tree.leaves(saved),
                             jax.tree.leaves(target)):
    assert got.sharding == like.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
