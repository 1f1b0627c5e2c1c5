"""Adaptive dyn.X: a re-plan is considered after every finished step and taken only where its
priced gain over `planner.every` steps beats the migration of what moves."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from moejax.config import ConfigError, PlannerConfig
from moejax.layout import host_layout as placement_lib
from moejax.placement import pricing
from moejax.placement.replanner import OnlinePlanner
from moejax.placement.trace_replay import replay
from moejax.train.controllers import Hook
from moejax.train.trainer import Trainer
from tests.plan_helpers import PLAN_COST
from tests.run_config import tiny_config

EXPERTS, DEVICES = 8, 4


def _skewed_counts_LxWxE(hot=(0, 1)) -> np.ndarray:
  """One layer: the experts in `hot` (both on device 0 under the static layout) take most rows."""
  c = np.full((1, DEVICES, EXPERTS), 10.0)
  c[:, :, list(hot)] = 400.0
  return c


def _planner(link_bytes_per_s: float, every: int = 10, policy: str = "smartmoe"):
  cost = dataclasses.replace(PLAN_COST, link_bytes_per_s=link_bytes_per_s)
  return OnlinePlanner(PlannerConfig(policy=policy, every=every, adaptive=True), DEVICES,
                       cost=cost)


def test_price_counts_the_copies_that_move_and_their_bytes():
  cur = placement_lib.static(EXPERTS, DEVICES)
  swapped = placement_lib.static(EXPERTS, DEVICES)
  se = swapped.slot_expert.copy()
  se[[1, 2]] = se[[2, 1]]                      # experts 1 and 2 trade devices 0 and 1
  new = dataclasses.replace(swapped, slot_expert=se)
  load = np.array([4.0, 1.0, 1.0, 1.0])
  p = pricing.price(cur, new, load, np.array([2.5, 2.5, 1.0, 1.0]), PLAN_COST, EXPERTS)
  assert p.moved == 2
  assert p.moved_bytes == 2 * 3 * PLAN_COST.expert_params * PLAN_COST.bytes_per_param
  assert p.move_s == pytest.approx(PLAN_COST.expert_move_s(1)), "each device receives one"
  assert p.gain_s == pytest.approx(PLAN_COST.compute_s(4.0) - PLAN_COST.compute_s(2.5))
  free = pricing.price(cur, new, load, load / 2, PLAN_COST, EXPERTS, moves_weights=False)
  assert (free.move_s, free.moved_bytes, free.moved) == (0.0, 0, 2)
  assert p.pays(10**6) and not p.pays(0) and not free._replace(gain_s=0.0).pays(10**6)


def test_adaptive_planner_is_due_every_step_and_switches_only_where_it_pays():
  cheap, dear = _planner(1e15), _planner(1.0)          # moving an expert: free vs forever
  start = [placement_lib.static(EXPERTS, DEVICES)]
  for op in (cheap, dear):
    op.observe(np.full((1, DEVICES, EXPERTS), 10.0))   # balanced: the cold start plan
    assert op.due(1)
    op.propose(start)
    op.observe(_skewed_counts_LxWxE())
    assert [s for s in range(2, 7) if op.due(s)] == [2, 3, 4, 5, 6]
  new, switches = cheap.propose(start)
  assert len(switches) == 1 and switches[0].gain_s > 0 and switches[0].moved_bytes > 0
  assert switches[0].gain_s * 10 > switches[0].move_s
  assert not np.array_equal(new[0].slot_expert, start[0].slot_expert)
  kept, none = dear.propose(start)
  assert none == [] and kept[0] is start[0], "a migration that never pays back is not made"


def test_the_trainers_plan_ahead_takes_the_cold_start_plan_even_where_it_does_not_pay():
  from moejax.train.plan_ahead import PlanAhead
  start = [placement_lib.static(EXPERTS, DEVICES)]
  for lag in (0, 1):
    dear = _planner(1.0)                                 # no later migration ever pays
    dear.observe(_skewed_counts_LxWxE())
    ahead = PlanAhead(lag, threaded=False)
    ahead.submit(1, 0, dear, start)
    (plan,) = ahead.take(1 + lag)
    new, switches, _ = plan.result()
    assert len(switches) == 1 and not np.array_equal(new[0].slot_expert, start[0].slot_expert)
    assert dear.planned
    dear.observe(_skewed_counts_LxWxE((2, 3)))
    ahead.submit(2, 0, dear, new)
    (plan,) = ahead.take(2 + lag)
    assert plan.result()[1] == [], "after the cold start a migration that never pays is not made"


def test_the_horizon_is_planner_every():
  p = _planner(1e15).cost
  start = [placement_lib.static(EXPERTS, DEVICES)]
  # A link at which the switch pays back over 1000 steps but not over 10.
  probe = _planner(1e15)
  probe.observe(_skewed_counts_LxWxE())
  probe.planned = True
  (sw,) = probe.propose(start)[1]
  link = sw.move_s * p.link_bytes_per_s / (100 * sw.gain_s)   # cost = 100 steps of gain
  for every, switched in ((10, False), (1000, True)):
    op = _planner(link, every=every)
    op.observe(_skewed_counts_LxWxE())
    op.planned = True
    assert bool(op.propose(start)[1]) == switched, every


def test_fsep_switches_move_no_weights():
  op = _planner(1.0, policy="fsep")
  op.observe(_skewed_counts_LxWxE())
  op.planned = True
  _, switches = op.propose([placement_lib.static(EXPERTS, DEVICES)])
  assert switches and all(s.move_s == 0.0 and s.moved_bytes == 0 for s in switches)


def test_adaptive_replay_prices_what_moves():
  rng = np.random.default_rng(0)
  counts = rng.poisson(20.0, size=(40, 1, DEVICES, EXPERTS)).astype(np.float64)
  counts[20:, :, :, :2] += 300.0          # a burst on device 0's experts halfway
  fixed = replay(counts, DEVICES, 2, "smartmoe", 1, 5, cost=PLAN_COST)
  unit = 3 * PLAN_COST.expert_params * PLAN_COST.bytes_per_param
  assert fixed["migrated_bytes"] == fixed["experts_moved"] * unit > 0
  dear = replay(counts, DEVICES, 2, "smartmoe", 10, 5, adaptive=True,
                cost=dataclasses.replace(PLAN_COST, link_bytes_per_s=1.0))
  assert dear["switches"] <= 1, "only the cold start's plan, never a priced one"
  cheap = replay(counts, DEVICES, 2, "smartmoe", 10, 5, adaptive=True,
                 cost=dataclasses.replace(PLAN_COST, link_bytes_per_s=1e15))
  assert cheap["switches"] > 2 and cheap["migrated_bytes"] == cheap["experts_moved"] * unit
  assert cheap["decisions"] == 39, "a candidate after every finished step"
  assert cheap["migration_s"] < dear["migration_s"] / 1e9


def test_adaptive_must_be_a_bool():
  with pytest.raises(ConfigError, match="planner.adaptive='yes'"):
    PlannerConfig(adaptive="yes").validate()


@pytest.mark.slow   # trains a tiny model: .ci/run's slow pass
def test_training_with_adaptive_replanning_switches_where_it_pays(tmp_path):
  """The trainer's own `due` / `propose` calls: a candidate before every step, the cold
  start's plan at step 1 or 2, later switches only where priced to pay (a 10^6-step horizon
  makes every gain pay here), each migrated by the moved-only program or the whole one."""
  base = tiny_config(tmp_path, num_steps=6, every=6, warmup_steps=2)
  cfg = dataclasses.replace(base, planner=PlannerConfig(
      policy="smartmoe", every=10**6, window=2, min_gain=0.0, adaptive=True))
  calls = []

  class Proposals(Hook):
    def before_step(self, trainer, step):
      calls.append(trainer.pool.planner.due(step))

  with Trainer(cfg) as trainer:
    trainer.run(hooks=[Proposals()])
    assert int(jax.device_get(trainer.state.step)) == 6
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  switches = [r for r in records if r.get("event") == "layout_switch"]
  assert switches and all(r["predicted_after"] <= r["predicted_before"] for r in switches)
  assert calls[2:] == [True] * (len(calls) - 2), "adaptive: due before every later step"


@pytest.mark.parametrize("policy,adaptive", [("fsep", True), ("fsep", False),
                                             ("smartmoe", True), ("smartmoe", False)])
def test_replay_switches_where_the_trainers_planner_does(policy, adaptive):
  """Replay and the trainer's re-planner take the same switches (the same rule,
  `pricing.decide`), so a replay's counts are the ones the trainer's run would make."""
  from moejax.layout.tables import round_robin_placement
  from moejax.placement.synthetic import synthetic_trace
  experts, devices, layers, steps, slots = 16, 4, 2, 41, 6
  counts = synthetic_trace(steps, layers, devices, experts, kind="lognormal", sigma=1.2,
                           corr=0.6, seed=3)["counts"]
  cost = dataclasses.replace(PLAN_COST, link_bytes_per_s=5e9)
  planner = OnlinePlanner(PlannerConfig(policy=policy, every=10, window=10, adaptive=adaptive),
                          devices, cost=cost)
  current = ([round_robin_placement(experts, devices, slots)] * layers if policy == "fsep"
             else [placement_lib.static(experts, devices)] * layers)
  switches, moved, moved_bytes = 0, 0, 0
  for t in range(steps):
    if planner.due(t):
      current, made = planner.propose(current)
      switches += len(made)
      moved += sum(s.experts_moved for s in made)
      moved_bytes += sum(s.moved_bytes for s in made)
    planner.observe(counts[t])
  r = replay(counts, devices, slots, policy, every=10, window=10, cost=cost,
             options=planner.options, adaptive=adaptive)
  assert switches > 0
  assert (r["switches"], r["experts_moved"], r["migrated_bytes"]) == (switches, moved,
                                                                      moved_bytes)
