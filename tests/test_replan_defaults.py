"""The re-planner's default per expert mode, and replay through the trainer's own re-planner.

fsep's layout switches move no weights, so by default it re-plans after every finished step
(planner.adaptive unset resolves on); ep's move weights and Adam moments, so it keeps the fixed
period. Held on a committed trace whose router collapses in the first steps of training:
under the fixed period the first plan, made from step 0's near-uniform counts, serves until
step `planner.every` (docs/decisions/0110)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np
import pytest

from moejax.config import Config, ConfigError, MoEConfig, PlannerConfig, TraceConfig
from moejax.layout import host_layout as placement_lib
from moejax.placement.replanner import OnlinePlanner, adaptive_for
from moejax.placement.synthetic import load_trace, synthetic_trace
from moejax.placement.trace_replay import replay_trainer
from moejax.train.pool import online_planner
from tests.plan_helpers import PLAN_COST
from tests.run_config import tiny_config

TRACE = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/traces/early_collapse.npz"
DEVICES, SLOTS, EXPERTS = 8, 8, 32


def _fsep_config(**planner) -> Config:
  """The trainer's defaults under fsep, at the trace's expert count: what `python train.py`
  runs with moe.expert_mode = 'fsep' and planner.policy = 'fsep' (slot-capacity dense
  dispatch at factor 1.25, every 50, window 10, the cpu profile's cost)."""
  return Config(moe=MoEConfig(num_experts=EXPERTS, expert_mode="fsep", slots_per_device=SLOTS),
                planner=PlannerConfig(policy="fsep", **planner))


def test_adaptive_unset_is_on_where_a_switch_moves_no_weights():
  assert PlannerConfig().adaptive is None
  assert adaptive_for(PlannerConfig(policy="fsep"))
  assert not adaptive_for(PlannerConfig(policy="smartmoe"))
  assert not adaptive_for(PlannerConfig(policy="static"))
  assert not adaptive_for(PlannerConfig(policy="fsep", adaptive=False))
  assert adaptive_for(PlannerConfig(policy="smartmoe", adaptive=True))
  PlannerConfig(policy="fsep").validate("fsep")
  with pytest.raises(ConfigError, match="planner.adaptive=1 must be True, False or None"):
    PlannerConfig(adaptive=1).validate()
  fsep = OnlinePlanner(PlannerConfig(policy="fsep", every=50), 4, cost=PLAN_COST)
  ep = OnlinePlanner(PlannerConfig(policy="smartmoe", every=50), 4, cost=PLAN_COST)
  for op in (fsep, ep):
    op.observe(np.ones((1, 4, 8)))
    op.propose([placement_lib.static(8, 4)])
  assert [s for s in range(1, 101) if fsep.due(s)] == list(range(1, 101))
  assert [s for s in range(1, 101) if ep.due(s)] == [50, 100]


def test_the_committed_trace_collapses_in_the_first_steps():
  """Step 0 near-uniform (the hottest expert under 1.5x the mean), every layer collapsed from
  step 3 on (one expert at ~40% of the choices, 12.8x the mean): what a fresh router that
  collapses early looks like, with 16 sources over 32 experts as the run the gap was found on."""
  counts = load_trace(TRACE)["counts"]
  assert counts.shape == (250, 2, 16, EXPERTS)
  share = counts.sum(2) / counts.sum((2, 3))[..., None]        # [steps, L, E]
  assert share[0].max() * EXPERTS < 1.5
  assert (share[3:].max(-1) > 0.3).all()


def test_fsep_default_follows_a_router_that_collapses_in_the_first_steps():
  """The trainer's fsep defaults, replayed through its own re-planner at N = 8, C = 8: p99 of
  the busiest device over the mean (steps x layers) <= 1.5. Under the fixed period (the old
  default, adaptive off) steps 2-49 run on the plan of step 0 at 1.67-2.32 and p99 is 2.25;
  re-planning after every step follows the collapse from step 3 on (p99 1.25, set by step 3,
  planned from steps 0-1). What no plan can follow is steps 1-2 (the loop reads a step's
  metrics one step late, so nothing collapsed has been read yet), 4 of the 500 values, under
  the 1% that p99 leaves out; 1.5 sits between the held collapse and a plan that follows it,
  so the test fails under the fixed period whatever the planner's rounding."""
  counts = load_trace(TRACE)["counts"]
  new = replay_trainer(counts, online_planner(_fsep_config(), DEVICES), SLOTS)
  old = replay_trainer(counts, online_planner(_fsep_config(adaptive=False), DEVICES), SLOTS)
  assert old["p99"] > 2.0, old["p99"]
  assert new["p99"] <= 1.5, new["p99"]
  assert new["median"] <= old["median"] + 0.005
  assert new["migrated_bytes"] == 0 and new["switches"] > old["switches"]


def test_replay_trainer_reads_metrics_one_step_late_and_chains_lagged_plans():
  """Before step t the planner holds steps up to t - 2 (t - 1 with fresh); the cold start
  plans before step 2 (1 with fresh); with lag k a plan is used from k steps after it was
  due."""
  counts = synthetic_trace(12, 1, 8, 16, kind="lognormal", sigma=1.5, seed=2)["counts"]
  seen = {}

  class Spy(OnlinePlanner):
    def due(self, step):
      seen.setdefault(self.tag, []).append(len(self.history))
      return super().due(step)

  for tag, fresh, lag in (("late", False, 0), ("fresh", True, 0), ("lag2", False, 2)):
    planner = Spy(PlannerConfig(policy="smartmoe", every=4, window=20, min_gain=0.0), 4,
                  cost=PLAN_COST)
    planner.tag = tag
    r = replay_trainer(counts, planner, SLOTS, fresh=fresh, lag=lag)
    steps = sorted({s for s, _, _ in r["switched"]})
    if tag == "late":
      assert seen[tag] == [0, 0, *range(1, 11)]
      assert steps and steps[0] == 2 and set(steps) <= {2, 4, 8}
    elif tag == "fresh":
      assert seen[tag] == list(range(12))
      assert steps and steps[0] == 1 and set(steps) <= {1, 4, 8}
    else:
      assert steps and steps[0] == 4 and set(steps) <= {4, 6, 10}
  with pytest.raises(ConfigError, match="divide by the planner's 3 devices"):
    replay_trainer(counts, OnlinePlanner(PlannerConfig(policy="fsep"), 3, cost=PLAN_COST), 8)


@pytest.mark.slow   # trains the tiny model twice: .ci/run's slow pass
@pytest.mark.parametrize("mode,policy", [("fsep", "fsep"), ("ep", "smartmoe")])
def test_replay_trainer_switches_where_training_does(tmp_path, mode, policy):
  """A run records its routing trace; `replay_trainer` on that trace, with the re-planner the
  run builds (`online_planner`), makes the switches the run made: the same steps, layers and
  experts moved (each mode's default adaptive rule, the loop's one-step-late reads)."""
  from moejax.train.trainer import Trainer
  base = tiny_config(tmp_path, num_steps=8, every=100, warmup_steps=2)
  cfg = dataclasses.replace(
      base, moe=dataclasses.replace(base.moe, expert_mode=mode),
      planner=PlannerConfig(policy=policy, every=3, window=2, min_gain=0.0),
      trace=TraceConfig(path=str(tmp_path / "trace.npz")))
  with Trainer(cfg) as trainer:
    trainer.run()
    devices = trainer.pool.program.mesh.shape["expert"]
    slots = trainer.pool.layout.slot_expert_LxS.shape[1] // devices
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    events = [json.loads(line) for line in f]
  made = [[r["step"], r["layer"], r["experts_moved"]] for r in events
          if r.get("event") == "layout_switch"]
  counts = load_trace(tmp_path / "trace.npz")["counts"]
  replayed = replay_trainer(counts, online_planner(cfg, devices), slots)
  assert made and replayed["switched"] == made


def test_replay_cli_takes_each_policys_trainer_default(tmp_path, capsys):
  """`python -m moejax.replay`: without --adaptive / --no-adaptive each row takes its policy's
  trainer default; --trainer replays the trainer's policies through its re-planner at
  planner.every's default; the trainer's options are not mixed with replay's --fsep."""
  from moejax import replay as replay_cli
  from moejax.placement.synthetic import save_trace
  trace, out = tmp_path / "t.npz", tmp_path / "out.json"
  save_trace(trace, synthetic_trace(8, 1, 8, 16, tokens_per_source=64, seed=1))
  common = [str(trace), "--devices", "4", "--slots", "8", "--no_oracle", "--json", str(out)]
  for extra, every, rows in (
      ([], 10, {"static": False, "smartmoe": False, "shadow": False, "fsep": True}),
      (["--no-adaptive"], 10, {"static": False, "smartmoe": False, "shadow": False,
                               "fsep": False}),
      (["--trainer"], PlannerConfig.every, {"static": False, "smartmoe": False, "fsep": True}),
      (["--trainer", "--adaptive"], PlannerConfig.every,
       {"static": True, "smartmoe": True, "fsep": True})):
    assert replay_cli.main(common + extra) == 0
    data = json.loads(out.read_text())
    assert data["every"] == every
    assert {k: r["adaptive"] for k, r in data["policies"].items()} == rows, extra
  fsep = data["policies"]["fsep"]
  assert fsep["decisions"] == 6 and fsep["switched"][0][0] == 2, "cold start before step 2"
  assert replay_cli.main(common + ["--trainer", "--fsep", "locality=False"]) == 2
  assert "--fsep sets replay's fsep options" in capsys.readouterr().err
