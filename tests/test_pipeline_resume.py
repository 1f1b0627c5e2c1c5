"""Checkpoints across mesh.stage and mesh.fsdp: the parameter tree is the same for every P and
with or without FSDP, so a checkpoint saved by one reads into the other's shardings."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from moejax.config import CheckpointConfig, Config, DataConfig, MeshConfig, OptimConfig, TrainConfig
from moejax.model.mesh import mesh_of_shape, param_rules
from moejax.model.transformer import Transformer
from moejax.strategy.spec import from_config
from moejax.train.checkpoint import Checkpointer
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import build_program, initial_layout
from moejax.train.state import init_state, state_shardings
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE

FOUR_GROUPS = dataclasses.replace(TINY_MOE, moe_every=1)


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


def _program(stage, virtual, micro=2):
  cfg = Config(
      mesh=MeshConfig(data=1, expert=2, stage=stage),
      model=dataclasses.replace(TINY_MODEL, vocab_size=256), moe=FOUR_GROUPS,
      data=DataConfig(global_batch_size=BATCH, seq_len=SEQ),
      train=TrainConfig(microbatches=micro, virtual_stages=virtual,
                        pipeline_schedule="circular" if virtual > 1 else "gpipe")).validate()
  tx = optimizer(cfg.optim, 10)
  devices = jax.devices()[:2 * stage]
  prog = build_program(cfg, from_config(cfg, len(devices)), tx, schedule(cfg.optim, 10),
                       devices, compile_now=False)
  return prog, init_state(prog.model, tx, prog.shardings, prog.layout, BATCH, SEQ, 0)


@pytest.mark.slow     # 157 s on this 2-core VM beside two pipeline compiles (two inits)
def test_circular_state_is_canonical_in_checkpoints():
  """A circular program (P=2, V=2) stores layer groups stage-major; its checkpoint form is
  the canonical one, which is a one-stage program's own state for the same seed, and it
  converts back exactly. So a checkpoint moves across P and V."""
  circ, state = _program(stage=2, virtual=2)
  one, want = _program(stage=1, virtual=1)
  np.testing.assert_array_equal(circ.layer_order, [0, 2, 1, 3])
  got = circ.canonical_state(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  back = circ.canonical_state(got, back=True)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moe_w = state.params["layers"]["moe"]["w_gate"]
  np.testing.assert_array_equal(np.asarray(moe_w[1]), np.asarray(
      want.params["layers"]["moe"]["w_gate"][2]), err_msg="storage row 1 = canonical group 2")
  assert one.canonical_state(want) is want      # one stage: nothing moves
