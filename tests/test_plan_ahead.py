"""Re-plans off the step's critical path (`planner.lag`): the layouts depend on the lag, never
on the planning thread's timing; a resume applies the same layouts at the same steps; a
planning error stops the loop at the step its plan was due."""

from __future__ import annotations

import json
import random
import time
import types

import numpy as np
import pytest

from moejax.config import ConfigError, PlannerConfig
from moejax.layout import host_layout as placement_lib
from moejax.layout.tables import static_layout, to_placements
from moejax.placement.replanner import OnlinePlanner
from moejax.train import plan_ahead
from moejax.train.controllers import LayoutReplanning
from moejax.train.plan_ahead import PlanAhead, PlanError
from tests.plan_helpers import PLAN_COST

LAYERS, DEVICES, EXPERTS, STEPS = 2, 4, 8, 14


def step_counts(seed=0):
  """[steps, L, W=8 sources, E]: a popularity that drifts, so the layouts keep changing."""
  rng = np.random.default_rng(seed)
  out = []
  for step in range(STEPS):
    popularity = np.roll(np.geomspace(8, 1, EXPERTS), step // 3)
    out.append(rng.poisson(popularity * 20, size=(LAYERS, 2 * DEVICES, EXPERTS)))
  return np.asarray(out, np.float64)


def new_planner():
  return OnlinePlanner(PlannerConfig(policy="smartmoe", every=1, window=3, min_gain=0.0),
                       DEVICES, cost=PLAN_COST)


def simulate(ahead, counts, start=0, stop=STEPS, planner=None, layout=None, applied=None):
  """The trainer's order around each step: plan when due, apply what is due now, dispatch;
  the planner sees a step's counts one step late. Returns what a checkpoint at `stop` holds
  and the layouts applied: [(step, planned_step, slot_expert per layer)]."""
  planner = planner or new_planner()
  layout = layout or [placement_lib.static(EXPERTS, DEVICES)] * LAYERS
  applied = [] if applied is None else applied
  for step in range(start, stop):
    if planner.due(step):
      ahead.submit(step, 0, planner, layout)
    for plan in ahead.take(step):
      new, switches, _ = plan.result()
      if switches:
        layout = new
        applied.append((step, plan.planned_step, [p.slot_expert.tolist() for p in new]))
    if step >= 1:
      planner.observe(counts[step - 1])
  return planner, layout, applied


@pytest.fixture
def jittery(monkeypatch):
  """Plans take a random 0-4 ms on the thread: a layout that depended on timing would move."""
  real, rng = plan_ahead._plan, random.Random(0)

  def slow(*args):
    time.sleep(rng.random() * 0.004)
    return real(*args)

  monkeypatch.setattr(plan_ahead, "_plan", slow)


@pytest.mark.parametrize("lag", [1, 3])
def test_planning_thread_gives_the_layouts_of_the_synchronous_reference(lag, jittery):
  counts = step_counts()
  threaded = PlanAhead(lag)
  try:
    got = simulate(threaded, counts)[2]
  finally:
    threaded.close()
  want = simulate(PlanAhead(lag, threaded=False), counts)[2]
  assert len(want) >= 4, "the drifting load should move experts several times"
  assert got == want
  assert all(step == planned + lag for step, planned, _ in got)
  lag0 = simulate(PlanAhead(0), counts)[2]
  assert all(step == planned for step, planned, _ in lag0)
  assert lag0 != want, "the lag changes which finished steps a layout was planned from"


@pytest.mark.parametrize("lag", [1, 3])
def test_resume_applies_the_same_layouts_at_the_same_steps(lag, jittery):
  counts = step_counts(seed=1)
  whole = simulate(PlanAhead(lag, threaded=False), counts)[2]
  for cut in (4, 9):
    first = PlanAhead(lag)
    planner, layout, applied = simulate(first, counts, stop=cut)
    saved = json.loads(json.dumps({"planner": planner.state_dict(),
                                   "pending": first.state_dict(),
                                   "layout": [plan_ahead.placement_to_json(p) for p in layout]}))
    assert saved["pending"], "a plan is in flight at the checkpoint"
    first.close()
    resumed, planner = PlanAhead(lag), new_planner()
    planner.load_state_dict(saved["planner"])
    resumed.load_state_dict(saved["pending"])
    layout = [plan_ahead.placement_from_json(p) for p in saved["layout"]]
    try:
      simulate(resumed, counts, start=cut, planner=planner, layout=layout, applied=applied)
    finally:
      resumed.close()
    assert applied == whole, f"resumed at step {cut}"


def fake_trainer():
  program = types.SimpleNamespace(mesh=types.SimpleNamespace(shape={"expert": DEVICES}))
  planner = new_planner()
  layout = static_layout(LAYERS, EXPERTS, DEVICES)
  pool = types.SimpleNamespace(planner=planner, planners=[planner], active=0, program=program,
                               layout=layout, placements=lambda: to_placements(layout, DEVICES))
  return types.SimpleNamespace(pool=pool)


def test_a_planning_error_stops_the_loop_at_the_step_the_plan_was_due(monkeypatch):
  def broken(*args, **kwargs):
    raise ValueError("no feasible placement")

  trainer = fake_trainer()
  monkeypatch.setattr(trainer.pool.planner, "policy", broken)
  hook = LayoutReplanning(lag=2)
  try:
    trainer.pool.planner.observe(step_counts()[0])
    assert not hook.before_step(trainer, 1)   # due (cold start): planned on the thread
    time.sleep(0.05)                          # it has failed by now; the loop goes on
    assert not hook.before_step(trainer, 2)
    with pytest.raises(PlanError, match=r"planned before step 1 for step 3 failed: "
                                        r"ValueError: no feasible placement"):
      hook.before_step(trainer, 3)
  finally:
    hook.close()


def test_planner_lag_must_be_a_count_of_steps():
  PlannerConfig(policy="smartmoe", lag=2).validate()
  for bad in (-1, 1.5, True):
    with pytest.raises(ConfigError, match=r"planner\.lag="):
      PlannerConfig(policy="smartmoe", lag=bad).validate()


def test_a_saved_plan_for_another_layout_shape_is_dropped_with_a_warning():
  """A checkpoint's pending re-plan resumed under another slot count (e.g. fsep's slots)."""
  trainer = fake_trainer()
  written = []
  trainer.writer = types.SimpleNamespace(write=written.append)
  other = placement_lib.Placement(np.arange(2 * EXPERTS, dtype=np.int32) % EXPERTS,
                                  np.full(2 * EXPERTS, 0.5), DEVICES, "split")
  hook = LayoutReplanning(lag=1)
  hook.load_state_dict([{"planned_step": 4, "apply_step": 5, "member": 0, "planning_s": 0.0,
                         "placements": [plan_ahead.placement_to_json(other)] * LAYERS,
                         "switches": [[0, 2.0, 1.0, 3]]}])
  assert not hook.before_step(trainer, 5)
  assert [w["event"] for w in written] == ["checkpoint_warning"]
  assert "planned before step 4" in written[0]["message"] and not hook.ahead.pending


@pytest.mark.slow   # three tiny runs: a minute or more on the 2-core VM
def test_training_with_a_lag_resumes_to_the_same_layouts_and_losses(tmp_path):
  import dataclasses

  from moejax.train.trainer import Trainer
  from tests.run_config import read_jsonl, step_losses, tiny_config

  def run(name, num_steps):
    base = tiny_config(tmp_path / name, num_steps=num_steps, every=3, warmup_steps=2)
    cfg = dataclasses.replace(
        base, optim=dataclasses.replace(base.optim, decay_steps=6),
        planner=PlannerConfig(policy="smartmoe", every=1, window=2, min_gain=0.0, lag=1))
    with Trainer(cfg) as trainer:
      trainer.run()
      return np.asarray(trainer.pool.layout.slot_expert_LxS), trainer.layouts

  whole, hook = run("whole", 6)
  run("cut", 3)
  resumed, _ = run("cut", 6)
  records = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("whole", "cut")}
  switches = {name: [(r["step"], r["planned_step"], r["layer"], r["experts_moved"])
                     for r in rs if r.get("event") == "layout_switch"]
              for name, rs in records.items()}
  assert switches["whole"] and all(s == p + 1 for s, p, _, _ in switches["whole"])
  assert switches["cut"] == switches["whole"]
  assert step_losses(records["cut"]) == step_losses(records["whole"])
  np.testing.assert_array_equal(resumed, whole)
  # Due at 2..5, applied at 3..5.
  assert hook.plans == 3 and hook.migrations >= 1 and hook.planning_s > 0
