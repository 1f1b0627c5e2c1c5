"""The drifting, bursty trace (its statistics), the oracle and regret in replay, and the fsep
planner that plans for the window's spread and keeps tokens local (numpy only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.layout import host_layout as placement_lib
from moejax.placement import fsep
from moejax.placement.drift import drift_bursts_trace, step_change
from moejax.placement.fsep.spread import recent_center, step_totals
from moejax.placement.synthetic import load_trace
from moejax.placement.trace_replay import oracle, replay, with_regret
from tests.plan_helpers import PLAN_COST

TRACE = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "drift_bursts.npz"


def test_drift_bursts_trace_has_the_asked_statistics():
  tr = drift_bursts_trace(steps=300, layers=1, seed=3, burst_rate=0.02)
  c = tr["counts"]
  assert c.shape == (300, 1, 16, 32) and np.all(c.sum(-1) == 2 * 2048)
  np.testing.assert_array_equal(c, drift_bursts_trace(steps=300, layers=1, seed=3,
                                                      burst_rate=0.02)["counts"])
  stats = step_change(c)
  assert 0.03 <= stats["hot_change_median"] <= 0.055, stats
  assert 0.10 <= stats["hot_change_p90"] <= 0.20, stats
  share = c.sum(2)[:, 0] / c.sum((2, 3))[:, 0, None]
  assert len(tr["bursts"]) >= 2
  for _, e, t0, dur in tr["bursts"]:
    assert 5 <= dur <= 20 or t0 + dur == 300
    others = [b for b in tr["bursts"] if b[1] == e and b[2] != t0]
    if t0 >= 5 and dur >= 5 and not others:              # a lone burst: its share triples
      ratio = share[t0:t0 + dur, e].mean() / share[t0 - 5:t0, e].mean()
      assert 2.0 <= ratio <= 4.5, (e, t0, ratio)
  with pytest.raises(ConfigError, match="lo <= hi"):
    drift_bursts_trace(steps=5, burst_steps=(6, 5))


def test_committed_trace_is_the_documented_one():
  c = load_trace(TRACE)["counts"]
  steps, layers, sources, experts = c.shape
  assert steps >= 500 and (sources, experts) == (16, 32)
  assert c.sum((2, 3)).min() >= 60_000
  stats = step_change(c)                                  # README: 4.0% / 14.3%
  assert stats["hot_change_median"] == pytest.approx(0.040, abs=0.003)
  assert stats["hot_change_p90"] == pytest.approx(0.143, abs=0.01)


@pytest.fixture(scope="module")
def drift():
  return load_trace(TRACE)["counts"][:80]


def test_oracle_bounds_the_lagged_planner_and_regret_is_the_difference(drift):
  bound = oracle(drift[:30], 8, 8, cost=PLAN_COST)
  assert bound["decisions"] == 30 * 2 and bound["median"] <= 1.01
  res = with_regret({"fsep": replay(drift[:30], 8, 8, "fsep", 10, 10, cost=PLAN_COST)},
                    bound)["fsep"]
  assert res["regret_median"] == pytest.approx(res["median"] - bound["median"])
  assert res["regret_p99"] == pytest.approx(res["p99"] - bound["p99"])
  assert res["regret_mean"] > 0 and res["p99"] >= res["p90"] >= res["median"]


def test_local_first_halves_crossing_at_no_cost_in_balance(drift):
  """On the drifting trace: crossing <= 0.75x the static layout's, the median within +0.01
  of the crossing-blind plan (same replicas and quotas, no kept parts)."""
  static = replay(drift, 8, 8, "static", 10, 10, cost=PLAN_COST)
  local = replay(drift, 8, 8, "fsep", 10, 10, cost=PLAN_COST)
  blind = replay(drift, 8, 8, "fsep", 10, 10, options=fsep.FsepOptions(locality=False),
                 cost=PLAN_COST)
  assert local["crossing_fraction"] <= 0.75 * static["crossing_fraction"]
  assert blind["crossing_fraction"] > 0.8 * static["crossing_fraction"]
  assert local["median"] <= blind["median"] + 0.01


def test_spread_plans_use_the_window_and_mean_plans_ignore_it(drift):
  pred = drift[10:20, 0].mean(0)
  static = placement_lib.static(32, 8)
  src = placement_lib.source_devices(16, 8)

  def plan(plan_for, samples):
    return fsep.place_replicas(pred, static, slots=8, src_dev_W=src, num_devices=8, cost=PLAN_COST,
                               options=fsep.FsepOptions(plan_for=plan_for),
                               samples_stepsxWxE=samples)

  a, b = plan("mean", drift[10:20, 0]), plan("mean", None)
  np.testing.assert_array_equal(a.slot_expert, b.slot_expert)
  np.testing.assert_array_equal(a.share, b.share)
  c = plan("spread", None)                                  # no window: the mean plan
  np.testing.assert_array_equal(c.slot_expert, b.slot_expert)
  for p in (plan("spread", drift[10:20, 0]), b):
    p.validate(32)
    assert placement_lib.one_per_device(p, 32)
  with pytest.raises(ConfigError, match="plan_for"):
    plan("median", None)


def test_planner_config_sets_spread_and_locality():
  from moejax.config import PlannerConfig
  from moejax.placement.replanner import OnlinePlanner
  cfg = PlannerConfig(policy="fsep", fsep_plan_for="mean", fsep_locality=False)
  cfg.validate("fsep")
  opts = OnlinePlanner(cfg, 4, capacity_factor=1.5, cost=PLAN_COST).options
  assert (opts.plan_for, opts.locality, opts.capacity_factor) == ("mean", False, 1.5)
  assert OnlinePlanner(PlannerConfig(policy="fsep"), 4, cost=PLAN_COST).options.plan_for == "spread"
  with pytest.raises(ConfigError, match="fsep_plan_for='median'") as err:
    PlannerConfig(policy="fsep", fsep_plan_for="median").validate("fsep")
  assert "\n" not in str(err.value)


def test_replanner_switches_when_only_the_kept_parts_change():
  from moejax.config import PlannerConfig
  from moejax.placement.replanner import OnlinePlanner
  planner = OnlinePlanner(PlannerConfig(policy="fsep", every=1), 8, cost=PLAN_COST)
  for step in load_trace(TRACE)["counts"][:3]:
    planner.observe(step)                  # [layers, 16 sources, experts], folded onto 8
  new, switches = planner.propose([placement_lib.static(32, 8)] * 2)
  assert len(switches) == 2 and new[0].local is not None
  blind = placement_lib.Placement(new[0].slot_expert, new[0].share, 8, "split")
  again, switches = planner.propose([blind, new[1]])
  assert [sw.layer for sw in switches] == [0]
  np.testing.assert_array_equal(placement_lib.local_parts(again[0]),
                                placement_lib.local_parts(new[0]))


def test_recent_center_ignores_one_spiking_step_and_keeps_the_source_split():
  rng = np.random.default_rng(0)
  win = rng.integers(50, 150, (10, 4, 6)).astype(float)           # [steps, W, E]
  win[-1, :, 2] *= 5                                                # one heavy-tailed step
  pred = win.mean(0)
  got = recent_center(pred, step_totals(win), 5)
  assert got.sum() == pytest.approx(pred.sum())
  np.testing.assert_allclose(got / got.sum(0), pred / pred.sum(0))   # each expert's split
  share = win[-5:].sum(1) / win[-5:].sum((1, 2))[:, None]
  want = np.median(share, axis=0)
  np.testing.assert_allclose(got.sum(0) / got.sum(), want / want.sum())
  assert got.sum(0)[2] < pred.sum(0)[2]                  # the mean still carries the spike
  np.testing.assert_array_equal(recent_center(pred * 0, step_totals(win), 5), pred * 0)


def test_center_option_is_checked_and_mean_keeps_the_window_mean(drift):
  pred, win = drift[10:20, 0].mean(0), drift[10:20, 0]
  src = placement_lib.source_devices(16, 8)

  def plan(**kw):
    return fsep.place_replicas(pred, placement_lib.static(32, 8), slots=8, src_dev_W=src,
                               num_devices=8, samples_stepsxWxE=win, cost=PLAN_COST,
                               options=fsep.FsepOptions(**kw))

  with pytest.raises(ConfigError, match="center='mode'"):
    plan(center="mode")
  with pytest.raises(ConfigError, match="center_steps=0"):
    plan(center_steps=0)
  a, b = plan(center="mean"), plan(center="median", center_steps=10)
  for p in (a, b):
    p.validate(32)
  assert not np.array_equal(a.share, b.share)
