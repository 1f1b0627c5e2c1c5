"""Placement under group-limited routing (moejax.placement.groups): smartmoe keeps each expert
group on its own devices (a block of N/G devices, or whole groups per device), plans the
blocks as smaller problems at the whole layer's buffer sizes, and the trainer's re-planner
takes it when moe.n_group > 1. Host-only, numpy."""

from __future__ import annotations

import numpy as np
import pytest

from moejax.config import PlannerConfig
from moejax.layout import host_layout as placement_lib
from moejax.placement import groups, smartmoe
from moejax.placement.replanner import OnlinePlanner
from tests.plan_helpers import PLAN_COST


def _skewed(rng, sources, experts, steps=None):
  """Counts with a few hot experts per group (heavy-tailed), [sources, experts] or per step."""
  hot = rng.pareto(1.2, experts) + 0.2
  shape = (sources, experts) if steps is None else (steps, sources, experts)
  return rng.poisson(40 * hot * rng.uniform(0.5, 1.5, shape)).astype(np.float64)


def _peak(placement, load_E):
  dev_E = np.empty(len(load_E), np.int64)
  dev_E[placement.slot_expert] = placement.device_of_slot
  return np.bincount(dev_E, weights=load_E, minlength=placement.num_devices).max()


def _devices_of_groups(placement, num_groups, num_experts):
  """For each group, the set of devices hosting one of its experts."""
  per = num_experts // num_groups
  return [set(placement.device_of_slot[placement.slot_expert // per == g].tolist())
          for g in range(num_groups)]


@pytest.mark.parametrize("experts, num_groups, n, how", [(32, 4, 8, "blocks"),
                                                         (16, 8, 4, "whole")])
def test_groups_stay_on_their_devices_and_load_levels(experts, num_groups, n, how):
  rng = np.random.default_rng(0)
  pred = _skewed(rng, n, experts)
  load_E = pred.sum(0)
  static = placement_lib.static(experts, n)
  assert groups.kept(experts, num_groups, n) == how and groups.respects(static, experts,
                                                                        num_groups)
  opts = smartmoe.SmartMoEOptions(min_gain=0.0)
  plan = groups.place_permutation(pred, static, num_groups=num_groups, options=opts)
  plan.validate(experts)
  assert groups.respects(plan, experts, num_groups)
  width = max(1, n // num_groups)     # the devices a group may use
  assert max(len(d) for d in _devices_of_groups(plan, num_groups, experts)) <= width
  assert _peak(plan, load_E) < _peak(static, load_E)
  # Unconstrained, smartmoe spreads some group over more devices: the constraint binds.
  free = smartmoe.place_permutation(pred, static, options=opts)
  assert max(len(d) for d in _devices_of_groups(free, num_groups, experts)) > width
  # Planned again from its own plan on the same load, nothing moves.
  assert groups.place_permutation(pred, plan, num_groups=num_groups, options=opts) is plan


def test_blocks_are_planned_alone_at_the_whole_layers_buffers():
  """Pooled capacity: each block's plan is smartmoe's on that block's experts and devices with
  the buffer rows of the whole layer (a source's choices to every expert / N)."""
  rng = np.random.default_rng(1)
  experts, num_groups, n, cf = 32, 4, 8, 1.25
  samples = _skewed(rng, n, experts, steps=4)
  pred = samples.mean(0)
  opts = smartmoe.SmartMoEOptions(min_gain=0.0, pooled_capacity_factor=cf)
  static = placement_lib.static(experts, n)
  plan = groups.place_permutation(pred, static, num_groups=num_groups, options=opts,
                                  samples_stepsxWxE=samples)
  assert groups.respects(plan, experts, num_groups)
  cap = np.ceil(cf * samples.sum(-1) / n)
  per, devices = experts // num_groups, n // num_groups
  for g in range(num_groups):
    block = slice(g * devices * (experts // n), (g + 1) * devices * (experts // n))
    sub = smartmoe.place_permutation(
        pred[:, g * per:(g + 1) * per], placement_lib.static(per, devices), options=opts,
        samples_stepsxWxE=samples[..., g * per:(g + 1) * per], cap_stepsxW=cap)
    np.testing.assert_array_equal(plan.slot_expert[block] - g * per, sub.slot_expert)
  dev = lambda p: np.argsort(p.slot_expert) // (experts // n)
  assert (smartmoe.pooled_drops(samples, dev(plan), n, cap) <
          smartmoe.pooled_drops(samples, dev(static), n, cap))


def test_a_layout_that_splits_groups_is_planned_from_static():
  """A current layout that spread a group (another run's, or planned without groups) is not
  kept: the plan starts from the static layout, which keeps the groups."""
  rng = np.random.default_rng(2)
  experts, num_groups, n = 32, 4, 8
  spread = placement_lib.one_copy(rng.permutation(experts), n)
  assert not groups.respects(spread, experts, num_groups)
  plan = groups.place_permutation(_skewed(rng, n, experts), spread, num_groups=num_groups,
                                  options=smartmoe.SmartMoEOptions(min_gain=0.5))
  assert groups.respects(plan, experts, num_groups)


def test_trainers_planner_keeps_groups():
  """The online planner of a run with moe.n_group = 4 proposes group-respecting layouts; the
  same planner without groups does not."""
  rng = np.random.default_rng(3)
  experts, n, layers = 32, 8, 2
  proposals = {}
  for num_groups in (1, 4):
    planner = OnlinePlanner(PlannerConfig(policy="smartmoe", every=1, window=2, min_gain=0.0),
                            n, PLAN_COST, num_groups=num_groups)
    for _ in range(2):
      planner.observe(np.stack([_skewed(rng, n, experts) for _ in range(layers)]))
    proposals[num_groups], _ = planner.propose([placement_lib.static(experts, n)] * layers)
  assert all(groups.respects(p, experts, 4) for p in proposals[4])
  assert not all(groups.respects(p, experts, 4) for p in proposals[1])
