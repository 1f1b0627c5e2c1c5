"""Online placement: lagged statistics, switches in training, trace, layout in checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from moejax.config import Config, ConfigError, PlannerConfig, TraceConfig
from moejax.layout import host_layout as placement_lib
from moejax.placement.replanner import OnlinePlanner
from moejax.train.controllers import Hook
from moejax.train.trainer import Trainer
from tests.plan_helpers import PLAN_COST
from tests.run_config import tiny_config


def test_observe_folds_data_rows_onto_expert_devices():
  op = OnlinePlanner(PlannerConfig(policy="smartmoe", every=2, window=3), num_devices=4,
                     cost=PLAN_COST)
  counts = np.arange(2 * 8 * 8).reshape(2, 8, 8)     # 2 layers, 8 sources = 2 rows x 4 devices
  op.observe(counts)
  np.testing.assert_array_equal(op.history[-1], counts[:, :4] + counts[:, 4:])


def test_smartmoe_samples_keep_a_devices_data_rows_apart():
  # The program sizes one buffer per (data row, device): pooled drops are scored per row.
  op = OnlinePlanner(PlannerConfig(policy="smartmoe", every=1, window=2), num_devices=4,
                     cost=PLAN_COST, capacity_factor=1.25, capacity="device")
  seen = []
  op.policy = lambda pred, cur, **kw: seen.append(kw["samples_stepsxWxE"]) or cur
  rng = np.random.default_rng(0)
  steps = [rng.integers(0, 50, (1, 8, 8)).astype(np.float64) for _ in range(3)]
  for counts in steps:
    op.observe(counts)
  op.propose([placement_lib.static(8, 4)])
  np.testing.assert_array_equal(seen[-1], np.stack(steps[-2:])[:, 0])     # rows, not sums
  clone = OnlinePlanner(op.cfg, 4, cost=PLAN_COST, capacity_factor=1.25, capacity="device")
  clone.load_state_dict(json.loads(json.dumps(op.state_dict())))
  clone.policy = op.policy
  clone.propose([placement_lib.static(8, 4)])
  np.testing.assert_array_equal(seen[-1], seen[-2])
  op.observe(np.ones((1, 2, 8)))       # another member's mesh: the folded history, until refilled
  op.propose([placement_lib.static(8, 4)])
  assert seen[-1].shape == (2, 4, 8)
  np.testing.assert_array_equal(seen[-1][-1], op.history[-1][0])


def test_observe_counts_from_another_members_mesh_keep_the_expert_totals():
  op = OnlinePlanner(PlannerConfig(policy="fsep", every=2, window=3), num_devices=8, cost=PLAN_COST)
  counts = np.arange(2 * 4 * 8, dtype=np.float64).reshape(2, 4, 8)   # 4 sources, not 8
  op.observe(counts)
  assert op.history[-1].shape == (2, 8, 8)
  np.testing.assert_allclose(op.history[-1].sum(1), counts.sum(1))
  np.testing.assert_allclose(op.history[-1][:, 0], op.history[-1][:, 7])   # spread evenly


def test_due_at_the_first_finished_step_then_every_x_steps():
  op = OnlinePlanner(PlannerConfig(policy="smartmoe", every=5), num_devices=4, cost=PLAN_COST)
  assert not op.due(1)                                # nothing observed yet
  op.observe(np.ones((1, 4, 8)))
  assert op.due(1) and op.due(2), "the cold start plans from the first finished step"
  op.propose([placement_lib.static(8, 4)])
  assert [s for s in range(12) if op.due(s)] == [5, 10]
  clone = OnlinePlanner(op.cfg, 4, cost=PLAN_COST)
  clone.load_state_dict(json.loads(json.dumps(op.state_dict())))
  assert [s for s in range(12) if clone.due(s)] == [5, 10], "a resumed run keeps its period"
  assert not OnlinePlanner(PlannerConfig(policy="static", every=5), 4, cost=PLAN_COST).due(5)


def test_fsep_every_sets_the_fsep_replanners_period_only():
  # The fixed period (fsep's default re-plans after every step: planner.adaptive unset).
  fsep = OnlinePlanner(PlannerConfig(policy="fsep", every=6, fsep_every=2, adaptive=False),
                       num_devices=4, cost=PLAN_COST)
  ep = OnlinePlanner(PlannerConfig(policy="smartmoe", every=6, fsep_every=2), num_devices=4,
                     cost=PLAN_COST)
  unset = OnlinePlanner(PlannerConfig(policy="fsep", every=6, adaptive=False), num_devices=4,
                        cost=PLAN_COST)
  for op in (fsep, ep, unset):
    op.observe(np.ones((1, 4, 8)))
    op.propose([placement_lib.static(8, 4)])
  assert [s for s in range(13) if fsep.due(s)] == [2, 4, 6, 8, 10, 12]
  assert [s for s in range(13) if ep.due(s)] == [6, 12]
  assert [s for s in range(13) if unset.due(s)] == [6, 12]


@pytest.mark.parametrize("kw, needle", [
    (dict(fsep_every=-1), "planner.fsep_every=-1"),
    (dict(fresh="yes"), "planner.fresh='yes'"),
])
def test_planner_config_errors_name_the_value(kw, needle):
  with pytest.raises(ConfigError) as e:
    PlannerConfig(policy="fsep", **kw).validate("fsep")
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_propose_balances_skewed_history_and_round_trips_state():
  op = OnlinePlanner(PlannerConfig(policy="smartmoe", every=1, window=2), num_devices=4,
                     cost=PLAN_COST)
  hot = np.zeros((1, 4, 8))
  hot[0, :, :2] = 100.0                               # experts 0 and 1 share device 0
  hot[0, :, 2:] = 10.0
  op.observe(hot)
  op.observe(hot)
  static = [placement_lib.static(8, 4)]
  new, switches = op.propose(static)
  assert len(switches) == 1 and switches[0].predicted_after < switches[0].predicted_before
  row = new[0].slot_expert.tolist()
  assert row.index(0) // 2 != row.index(1) // 2
  clone = OnlinePlanner(op.cfg, 4, cost=PLAN_COST)
  clone.load_state_dict(json.loads(json.dumps(op.state_dict())))
  np.testing.assert_array_equal(clone.propose(static)[0][0].slot_expert, new[0].slot_expert)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_training_switches_layouts_records_trace_and_resumes_layout(tmp_path):
  trace_path = str(tmp_path / "trace.npz")
  base = tiny_config(tmp_path, num_steps=6, every=6, warmup_steps=2)
  cfg = dataclasses.replace(
      base, planner=PlannerConfig(policy="smartmoe", every=2, window=2, min_gain=0.0),
      trace=TraceConfig(path=trace_path))
  with Trainer(cfg) as trainer:
    trainer.run()
    saved_layout = np.asarray(trainer.pool.layout.slot_expert_LxS)
    saved_params = jax.device_get(trainer.state.params)
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  switches = [r for r in records if r.get("event") == "layout_switch"]
  assert switches, "a skewed random router should trigger at least one smartmoe switch"
  assert all(r["step"] in (2, 4) and r["predicted_after"] < r["predicted_before"]
             for r in switches)
  assert not np.array_equal(saved_layout, np.tile(np.arange(8), (1, 1)))
  with np.load(trace_path) as t:
    assert t["counts"].shape == (6, 1, 8, 8)
    np.testing.assert_array_equal(t["step"], np.arange(6))
    assert int(t["top_k"]) == 2
    assert np.all(t["counts"].sum((2, 3)) == 8 * 32 * 2)

  with Trainer(dataclasses.replace(
      cfg, train=dataclasses.replace(cfg.train, num_steps=8))) as resumed:
    assert resumed.maybe_restore() == 6
    np.testing.assert_array_equal(np.asarray(resumed.pool.layout.slot_expert_LxS), saved_layout)
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state.params)),
                    jax.tree.leaves(saved_params)):
      np.testing.assert_array_equal(a, b)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_fresh_planning_sees_the_step_just_finished(tmp_path):
  """planner.fresh: before step s is dispatched the re-planner holds the counts of steps
  0..s-1, so with every=1 the first re-plan comes at step 1 (without it, step s sees up to
  s-2 and the first re-plan can come at step 2 at the earliest)."""
  base = tiny_config(tmp_path, num_steps=4, every=100, warmup_steps=2)
  seen = {}

  class PlannerHistory(Hook):   # how many finished steps the re-planner holds before each step
    def __init__(self, fresh):
      self.fresh = fresh

    def before_step(self, trainer, step):
      seen[self.fresh].append(len(trainer.pool.planner.history))

  def runs(fresh):
    cfg = dataclasses.replace(
        base, moe=dataclasses.replace(base.moe, expert_mode="fsep", slots_per_device=4),
        planner=PlannerConfig(policy="fsep", every=1, window=10, fresh=fresh),
        train=dataclasses.replace(base.train, run_dir=str(tmp_path / f"fresh_{fresh}")))
    with Trainer(cfg) as trainer:
      seen[fresh] = []
      trainer.run(hooks=[PlannerHistory(fresh)])
    with open(os.path.join(cfg.train.run_dir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]
    return sorted({r["step"] for r in records if r.get("event") == "layout_switch"})

  fresh_switches, lagged_switches = runs(True), runs(False)
  assert seen[True] == [0, 1, 2, 3]
  assert seen[False] == [0, 0, 1, 2]
  assert fresh_switches and fresh_switches[0] == 1
  assert lagged_switches and lagged_switches[0] == 2


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_fsep_training_relayouts_without_migration_or_recompiling(tmp_path):
  base = tiny_config(tmp_path, num_steps=6, every=3, warmup_steps=2)
  cfg = dataclasses.replace(
      base, moe=dataclasses.replace(base.moe, expert_mode="fsep", slots_per_device=4),
      planner=PlannerConfig(policy="fsep", every=2, window=2, adaptive=False))
  with Trainer(cfg) as trainer:
    start_layout = np.asarray(trainer.pool.layout.slot_expert_LxS).copy()
    compiled = trainer.pool.program.train_step
    trainer.run()
    # Every step, re-layouts included, ran this one ahead-of-time executable, which cannot
    # recompile (a layout of another shape or dtype would be refused, not retraced).
    assert isinstance(compiled, jax.stages.Compiled)
    assert trainer.pool.program.train_step is compiled, "a re-layout replaced the fsep step"
    final = trainer.pool.layout
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  switches = [r for r in records if r.get("event") == "layout_switch"]
  assert switches and {r["step"] for r in switches} <= {2, 4}
  assert not np.array_equal(np.asarray(final.slot_expert_LxS), start_layout)
  assert final.expert_slots_LxExR.shape == (1, 8, 4)
  assert all(m["dropped_fraction"] >= 0 and len(m["device_load"]) == 8
             for r in records if "moe" in r for m in r["moe"])
  with Trainer(dataclasses.replace(
      cfg, train=dataclasses.replace(cfg.train, num_steps=7))) as resumed:
    assert resumed.maybe_restore() == 6
    np.testing.assert_array_equal(np.asarray(resumed.pool.layout.expert_parts_LxExR),
                                  np.asarray(final.expert_parts_LxExR))


def test_trace_sources_are_stored_expert_major(tmp_path):
  """The step orders sources (data, expert); the trace stores them so that source s ran on
  expert-axis device s*N // S (the replay mapping)."""
  from moejax.placement.trace import TraceRecorder
  rec = TraceRecorder(str(tmp_path / "t.npz"), top_k=1)
  counts = np.arange(1 * 8 * 3).reshape(1, 8, 3)      # 2 data rows x 4 devices, 3 experts
  rec.add(0, counts, expert_devices=4)
  rec.write()
  with np.load(tmp_path / "t.npz") as t:
    stored = t["counts"][0, 0]
  for s in range(8):
    device, row = s * 4 // 8, s % 2
    np.testing.assert_array_equal(stored[s], counts[0, row * 4 + device])


def test_the_trainers_planner_plans_with_the_runs_model_hardware_and_capacity():
  """The re-planner the strategy pool builds (`online_planner`) weighs compute against the
  exchange with the config's d_model, expert d_ff and dtype on the configured hardware
  profile's rates, and plans fsep for the dense dispatch's capacity factor and mode."""
  from moejax.strategy.cost import PRESETS
  from moejax.train.pool import online_planner
  cfg = Config()
  cfg = dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, d_model=48, dtype="bfloat16"),
      moe=dataclasses.replace(cfg.moe, d_ff=80, expert_mode="fsep", capacity="device",
                              capacity_factor=1.5),
      planner=dataclasses.replace(cfg.planner, policy="fsep"),
      strategy=dataclasses.replace(cfg.strategy, profile="h100_node"))
  planner = online_planner(cfg, 4)
  profile = PRESETS["h100_node"]
  assert (planner.cost.d_model, planner.cost.d_ff, planner.cost.act_bytes) == (48, 80, 2)
  # pooled capacity runs the grouped kernel; per-slot buffers through XLA a dense dot
  assert planner.cost.flops_per_s == profile.grouped_flops_per_s / profile.compute_scale
  slot = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity="slot"))
  assert online_planner(slot, 4).cost.flops_per_s == profile.flops_per_s / profile.compute_scale
  assert planner.cost.link_bytes_per_s == profile.a2a_bytes_per_s / profile.comm_scale
  assert (planner.options.capacity_factor, planner.options.capacity) == (1.5, "device")
  ragged = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch="ragged"))
  assert online_planner(ragged, 4).options.capacity_factor is None
