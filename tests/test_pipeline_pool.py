"""An online strategy pool under pipeline stages (circular, P = 2, V = 2) switches members, and
every step of the run equals a one-device run's.

The pool's members share P, V, M and FSDP (docs/decisions/0045) and differ in mesh and
capacity factor: member 0 (1x4x1, cf8) is predicted slower than member 1 (2x2x1, cf4) by the
CPU profile, and a horizon of 10^6 steps makes that gain beat any switch cost, so the online
stage moves to member 1 at its first decision (step 2). SmartMoE re-places the experts of the
active member every step (fresh metrics), so the switch moves a state whose layout differs per
layer, through the stage-major storage. cf >= 4 cannot drop a choice at 16 tokens per source
(each token picks an expert once: at most 16 choices per (source, expert), capacity 4 x 16 x
2 / 8), nor on one device (64 tokens a microbatch), so every member computes one function: the
one-device run over the same batches (P = 1, M = 2: the same microbatch split) is the
reference, loss by loss. A full Trainer, two pipelined members and the reference compile for
minutes on the 2-core VM, hence `slow`.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from moejax.config import (
  CheckpointConfig,
  Config,
  ConfigError,
  DataConfig,
  MeshConfig,
  ModelConfig,
  MoEConfig,
  OptimConfig,
  PlannerConfig,
  StrategyConfig,
  TrainConfig,
)
from moejax.strategy.spec import check_pool, parse
from moejax.train.trainer import Trainer
from tests.moe_helpers import model_lengths
from tests.numerics import assert_close

POOL = ("ep/1x4x1/p2/v2/m2/cf8", "ep/2x2x1/p2/v2/m2/cf4")
STEPS = 4


def _config(run_dir, mesh: MeshConfig, train: dict, **parts) -> Config:
  return Config(
      mesh=mesh,
      model=ModelConfig(d_model=32, num_layers=4, num_heads=2, d_ff=64, max_seq_len=16),
      moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=4.0, d_ff=32, moe_every=1),
      data=DataConfig(seq_len=16, global_batch_size=8, max_corpus_bytes=100_000),
      optim=OptimConfig(learning_rate=1e-2, warmup_steps=1),
      checkpoint=CheckpointConfig(every=100),
      train=TrainConfig(run_dir=str(run_dir), num_steps=STEPS, eval_every=100, eval_batches=1,
                        progress_bar=False, tensorboard=False, microbatches=2, **train),
      **parts)


def _records(run_dir) -> list[dict]:
  with open(run_dir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_a_pool_of_one_pipeline_validates_and_a_stranger_is_named(tmp_path):
  cfg = _config(tmp_path, MeshConfig(stage=2, data=1, expert=4),
                dict(pipeline_schedule="circular", virtual_stages=2),
                strategy=StrategyConfig(pool=POOL, every=2)).validate()
  check_pool([parse(s) for s in POOL], cfg, 8)
  stranger = "ep/1x4x1/p2/m2/cf4"   # V = 1: GPipe, another storage order and schedule
  with pytest.raises(ConfigError) as e:
    check_pool([parse(POOL[0]), parse(stranger)], cfg, 8)
  msg = str(e.value)
  assert "\n" not in msg and f"strategy {stranger} has p2/v1/m2" in msg, msg
  assert "train.virtual_stages=2" in msg and "share one pipeline" in msg, msg


def test_plan_prints_the_bindings_that_train_a_pipelined_pool():
  """`moejax.plan`'s "train with" line for a P = 2, V = 2 pool parses to a config that runs
  that pool (the circular schedule included)."""
  from moejax.frontend import parse_config
  from moejax.strategy.offline import train_bindings

  bindings = train_bindings([parse(s) for s in POOL])
  cfg = parse_config([], bindings + ["model.num_layers = 8"]).validate()
  assert (cfg.mesh.stage, cfg.train.microbatches, cfg.train.virtual_stages) == (2, 2, 2)
  assert cfg.train.pipeline_schedule == "circular" and cfg.strategy.pool == POOL
  check_pool([parse(s) for s in cfg.strategy.pool], cfg, 8)


def _pooled_config(tmp_path, pool) -> Config:
  """The run of `pool` on P = 2 circular stages (V = 2) of expert 4, switching every 2 steps
  and SmartMoE re-placing every step. max_drop 0.1: the cf4 member's predicted drops under
  the tiny router's load (0.65% here) stay far under it on any CPU; the real drops are zero
  (module docstring)."""
  return _config(
      tmp_path / "pool", MeshConfig(stage=2, data=1, expert=4),
      dict(pipeline_schedule="circular", virtual_stages=2),
      strategy=StrategyConfig(pool=pool, every=2, horizon=10**6, max_drop=0.1),
      planner=PlannerConfig(policy="smartmoe", every=1, window=1, min_gain=0.0, fresh=True))


@pytest.mark.slow
def test_pool_under_stages_switches_and_each_step_equals_one_device(tmp_path):
  pooled = _pooled_config(tmp_path, POOL)
  with Trainer(pooled) as trainer:
    trainer.run()
  records = _records(tmp_path / "pool")
  switches = [r for r in records if r.get("event") == "strategy_switch"]
  assert [(r["step"], r["from"], r["to"], r["reason"]) for r in switches] == [
      (2, POOL[0], POOL[1], "time")]
  ran = {r["step"]: r["strategy"] for r in records if "loss" in r}
  assert ran == {0: POOL[0], 1: POOL[0], 2: POOL[1], 3: POOL[1]}
  moves = [r for r in records if r.get("event") == "layout_switch"]
  assert {r["step"] for r in moves} >= {1, 2}, "SmartMoE re-placed both members' experts"

  _assert_steps_equal_one_device(tmp_path, pooled, records)


def _assert_steps_equal_one_device(tmp_path, pooled: Config, records: list[dict],
                                   expert_mode: str = "ep") -> None:
  """Every step's loss of the pooled run equals a one-device run's over the same batches
  (P = 1, M = 2), and no choice was dropped. `expert_mode`: the first member's, whose fresh
  state the run starts from (an fsep model initialises its experts apart from an ep one)."""
  one = _config(tmp_path / "one", MeshConfig(data=1, expert=1, model=1), {})
  one = dataclasses.replace(one, moe=dataclasses.replace(one.moe, expert_mode=expert_mode))
  with Trainer(one, devices=jax.devices()[:1]) as reference:
    reference.run()
  want = {r["step"]: r["loss"] for r in _records(tmp_path / "one") if "loss" in r}
  got = {r["step"]: r["loss"] for r in records if "loss" in r}
  assert sorted(got) == sorted(want) == list(range(STEPS))
  _, grad_len = model_lengths(pooled.model, pooled.moe)
  for step in range(STEPS):   # each step's loss sits on every earlier step's gradient
    assert_close(got[step], want[step], grad_len * (step + 1), err_msg=f"step {step}")
  assert all(r["moe"][0]["dropped_fraction"] == 0 for r in records if "loss" in r)


@pytest.mark.slow
def test_pool_under_stages_switches_from_fsep_to_ep_and_equals_one_device(tmp_path):
  """The same run with an fsep member first (4 slots per device, each expert twice; cf8
  cannot drop: 16 slots x 16 tokens hold every choice), which the CPU profile predicts slower
  than the ep member: the switch moves the fsep state (every expert sharded over the stage's
  4 devices, stored stage-major) to ep slots."""
  pool = ("fsep/1x4x1/p2/v2/m2/c4/cf8", "ep/1x4x1/p2/v2/m2/cf4")
  pooled = _pooled_config(tmp_path, pool)
  with Trainer(pooled) as trainer:
    trainer.run()
    final = jax.device_get(trainer.state)
  # The last checkpoint (member 0's form, canonical rows) resumes on the member that ran last,
  # in that member's stored order, bit for bit.
  with Trainer(pooled) as resumed:
    assert resumed.maybe_restore() == STEPS
    assert resumed.pool.program.strategy.spec == pool[1]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(resumed.state)),
                            jax.tree.leaves(final), strict=True):
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  records = _records(tmp_path / "pool")
  switches = [r for r in records if r.get("event") == "strategy_switch"]
  assert [(r["step"], r["from"], r["to"], r["reason"]) for r in switches] == [
      (2, pool[0], pool[1], "time")]
  ran = {r["step"]: r["strategy"] for r in records if "loss" in r}
  assert ran == {0: pool[0], 1: pool[0], 2: pool[1], 3: pool[1]}
  _assert_steps_equal_one_device(tmp_path, pooled, records, expert_mode="fsep")
