"""The cluster study (benchmarks.cluster): its routings keep what they are scaled from, its
capacity factors are the smallest that hold the drop target, its step arithmetic, and, with
the compile-only plugin (`slow`, the GPU-program pass of .ci/run), its smallest case end to
end: 8 GPUs, Mixtral-8x7B cut to 2 layers, static EP and fsep on drift-bursts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks.cluster import programs, replays, routing, study
from moejax.aot import gpus
from moejax.frontend import parse_config
from moejax.placement.buffers import MAX_DROPPED


def test_split_experts_keep_each_share_over_the_mean():
  """A target with m times the trace's experts splits each into m of equal share: the
  sorted shares over the mean are the trace's, each repeated m times."""
  rng = np.random.default_rng(0)
  shares = rng.dirichlet(np.ones(8), size=(3, 2))
  split = routing.map_experts(shares, 32)
  assert np.allclose(split.sum(-1), 1)
  want = np.sort(np.repeat(shares * 8, 4, axis=-1), -1)
  assert np.allclose(np.sort(split * 32, -1), want)


def test_merged_experts_are_groups_of_the_trace():
  rng = np.random.default_rng(1)
  shares = rng.dirichlet(np.ones(32), size=(2,))
  merged = routing.map_experts(shares, 8)
  assert np.allclose(merged.sum(-1), 1)
  order = np.random.default_rng(0).permutation(32)
  assert np.allclose(merged, shares[:, order].reshape(2, 8, 4).sum(-1))


def test_no_expert_takes_more_than_one_choice_a_token():
  p = np.array([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
  capped = routing.cap_shares(p, 2)
  assert np.allclose(capped.sum(-1), 1) and capped.max() <= 0.5 + 1e-12
  assert np.allclose(capped[1], p[1])
  assert np.allclose(capped[0], [0.5, 1 / 6, 1 / 6, 1 / 6])


def test_scaled_trace_has_the_targets_sources_and_choices():
  counts = routing.scaled_counts("default_run", 16, 4, 2048, 2, steps=5)
  assert counts.shape == (5, 2, 4, 16)
  assert (counts.sum(-1) == 2048).all() and (counts <= 1024).all()
  # The own trace (8 sources of 512 choices) is pooled into one source of 4,096.
  trace = np.load(routing.TRACES["default_run"])["counts"][:5]
  assert routing.pooled_shares(trace).shape == (5, 2, 1, 8)


def test_uniform_routing_is_exact_and_needs_factor_one():
  counts = routing.uniform_counts(8, 8, 4096)
  assert (counts == 512).all()
  assert replays.ragged_factor(replays.static_loads(counts, 8), 4096) == pytest.approx(
      1 - MAX_DROPPED, abs=1e-3)


def test_ragged_factor_is_the_smallest_that_holds_the_drop_target():
  rng = np.random.default_rng(2)
  loads = rng.integers(500, 2000, size=(20, 2, 8)).astype(float)
  f = replays.ragged_factor(loads, 1000)

  def dropped(factor):
    return np.maximum(loads - math.ceil(factor * 1000), 0).sum() / loads.sum()

  assert dropped(f) <= MAX_DROPPED < dropped(f - 2e-3)


def test_factors_round_up_to_the_grid():
  assert study.on_grid(0.97) == 1.0
  assert study.on_grid(1.0) == 1.0
  assert study.on_grid(1.0001) == 1.125
  assert study.on_grid(1.81) == 1.875
  assert study.on_grid(1.25, 0.25) == 1.25


def test_busiest_device_scales_only_the_grouped_matmul():
  row = {"step_s": 10.0, "grouped_matmul": {"seconds": 4.0, "rows": 1000}}
  assert programs.busiest_step(row, 1.0, 2.0)["scaled_step_s"] == pytest.approx(8.0)
  assert programs.busiest_step(row, 2.5, 2.0)["scaled_step_s"] == pytest.approx(10.0)


def test_replan_is_paid_beyond_the_step_in_flight():
  rp = {"planner_ms_per_layer": 100.0, "every": 10, "migration_s": 2.0, "steps": 100,
        "layers": 2, "migrated_bytes": 400}
  paid = study.priced(1.0, rp, 32)
  assert paid["replan_s"] == pytest.approx(3.2)
  assert paid["replan_exposed_s"] == pytest.approx(0.22)
  assert paid["migration_s"] == pytest.approx(2.0 / 200 * 32)
  assert study.priced(5.0, rp, 32)["replan_exposed_s"] == 0.0


def test_replays_use_the_trainers_planner_options():
  cfg = parse_config([programs.MODELS["mixtral_8x7b"]], ["data.path = None"])
  counts = routing.scaled_counts("default_run", 8, 8, 4096, 2, steps=12)
  got = {p: replays.replay_policy(cfg, p, counts, 8) for p in ("static", "fsep_planned")}
  assert got["static"]["planner_ms_per_layer"] is None
  fsep = got["fsep_planned"]
  assert fsep["slots"] == 2 and fsep["decisions"] > 0 and fsep["migrated_bytes"] == 0
  assert fsep["options"]["capacity"] == "device" and fsep["profile"] == "h100_node"
  for r in got.values():
    assert 0.5 < r["capacity_factor"] < 8 and r["busiest_over_mean"] >= 0.99


@pytest.mark.slow
@pytest.mark.skipif(gpus.has_cuda_plugin() is not None, reason=str(gpus.has_cuda_plugin()))
def test_smallest_case_end_to_end(tmp_path):
  """8 compile-only H100s, Mixtral-8x7B at 2 layers, static EP and fsep planned, uniform and
  drift-bursts' first 60 steps: every row compiled and estimated, the force-balanced row is
  the denominator, and fsep, which needs a smaller buffer there, is faster than static EP."""
  out = tmp_path / "cluster.json"
  assert study.main(["--smoke", "--cache", str(tmp_path / "cache.json"),
                     "--json", str(out)]) == 0
  d = json.loads(out.read_text())
  rows = {(r["routing"], r["policy"]): r for r in d["rows"]}
  assert set(rows) == {(t, p) for t in ("uniform", "drift_bursts")
                       for p in ("static", "fsep_planned")}
  assert all("step_s" in r and r["gpus"] == 8 for r in rows.values())
  assert rows["uniform", "static"]["fraction_of_balanced"] == pytest.approx(1.0)
  skewed = rows["drift_bursts", "static"]
  assert skewed["needed_factor"] > 1.5 and skewed["fraction_of_balanced"] < 1.0
  fsep = rows["drift_bursts", "fsep_planned"]
  assert fsep["needed_factor"] < skewed["needed_factor"] and fsep["speedup_over_static"] > 1.0
  for p in d["programs"].values():
    assert p["compiled"] and p["spec"]["layers"] == 2 and p["compile_s"] > 0
