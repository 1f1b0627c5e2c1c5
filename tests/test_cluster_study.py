"""The cluster study (benchmarks.cluster): its routings keep what they are scaled from, its
capacity factors are the smallest that hold the drop target, its step arithmetic, and, with
the compile-only plugin (`slow`, the GPU-program pass of .ci/run), its smallest case end to
end: 8 GPUs, Mixtral-8x7B cut to 2 layers, static EP and fsep on drift-bursts."""

from __future__ import annotations

import dataclasses
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


def _program(spec: programs.Spec) -> dict:
  """A program row as `programs.compile_row` reads one, every number a fixed part plus
  layers x a per-layer part that grows with the buffer."""
  per = 0.1 + 0.05 * spec.factor

  def lin(fixed, per_layer):
    return fixed + spec.layers * per_layer

  return {"spec": dataclasses.asdict(spec), "gpu": "h100", "compiled": True, "strategy": "",
          "lower_s": 1.0, "compile_s": 2.0, "wall_s": 3.0,
          "step_s": lin(0.3, per), "compute_s": lin(0.2, 0.8 * per),
          "comm_s": lin(0.1, 0.3 * per), "exposed_comm_s": lin(0.1, 0.2 * per),
          "by_category": {"gemm": lin(0.1, 0.5 * per)}, "comm_by": {"all-to-all": lin(0, per)},
          "exposed_by": {"all-to-all": lin(0.05, 0.1 * per)},
          "compute_by": {"gemm": lin(0.1, 0.5 * per)},
          "grouped_matmul": {"seconds": lin(0.0, 0.4 * per), "rows": 4096},
          "peak_bytes": lin(2e9, 1e8 * spec.factor), "fits": True}


def test_extrapolated_row_is_the_program_at_the_models_depth():
  """Two cut depths give every number of the row at the full depth (fixed + layers x
  per-layer), nested ones too, and say which depths they came from."""
  spec = programs.Spec("mixtral_8x7b", "1x1x8", "ep", 1.25)
  cut = {d: _program(dataclasses.replace(spec, layers=d)) for d in (4, 2)}
  got = programs.extrapolate(cut, 32)
  want = _program(dataclasses.replace(spec, layers=32))
  for key in ("step_s", "compute_s", "exposed_comm_s", "peak_bytes"):
    assert got[key] == pytest.approx(want[key])
  assert got["grouped_matmul"]["seconds"] == pytest.approx(want["grouped_matmul"]["seconds"])
  assert got["exposed_by"]["all-to-all"] == pytest.approx(want["exposed_by"]["all-to-all"])
  assert got["per_layer_s"] == pytest.approx(0.1 + 0.05 * 1.25)
  assert got["extrapolated"] == [2, 4] and got["depth"] == 32 and got["compiled"]


def test_study_rows_extrapolate_from_the_cut_depths(monkeypatch):
  """With depths, every program the study compiles is at one of the two cut depths, and
  each row's program (and the denominator) is the one at the model's depth, interpolated in
  the buffer and extrapolated in depth; the rows say from which depths."""
  compiled = []

  def compile_row(spec, gpu="h100", hlo_dir=None):
    compiled.append(spec)
    return _program(spec)

  monkeypatch.setattr(programs, "compile_row", compile_row)
  d = study.run(["mixtral_8x7b"], {"mixtral_8x7b": (8,)}, ["uniform", "drift_bursts"],
                ["static", "fsep_planned"], programs.Cache(None), study.GRID, 12,
                depths=(2, 4), log=lambda *_: None)
  depth = parse_config([programs.MODELS["mixtral_8x7b"]], ["data.path = None"]).model.num_layers
  assert compiled and {s.layers for s in compiled} == {2, 4}
  den = d["denominators"]["mixtral_8x7b/8"]
  base = programs.Spec("mixtral_8x7b", "1x1x8", "ep", 1.0, depth)
  assert den["step_s"] == pytest.approx(_program(base)["step_s"])
  assert den["extrapolated_from"] == [2, 4]
  assert len(d["rows"]) == 4
  for r in d["rows"]:
    want = _program(dataclasses.replace(base, kind=programs.kind_of(
        r["policy"], r["kernels"], r["exchange_recomputed"]), factor=r["factor"]))
    assert r["layers"] == depth and r["extrapolated_from"] == [2, 4]
    assert r["program_step_s"] == pytest.approx(want["step_s"])
    assert r["program_grouped_matmul_s"] == pytest.approx(want["grouped_matmul"]["seconds"])
    assert set(r["programs"]) <= {s.key() for s in compiled}
    assert len(r["programs"]) == (2 if r["factor"] == 1.0 else 4)
    # the other programs (the other kernels, and Mixtral's exchange recomputed on both) were
    # compiled and kept beside the row
    assert sorted((a["kernels"], a["exchange_recomputed"]) for a in r["alternatives"]) == sorted(
        v for v in study.variants(study.Case.of("mixtral_8x7b", 8), r["policy"],
                                  programs.KERNELS)
        if v != (r["kernels"], r["exchange_recomputed"]))
    assert set(r["alternatives"][0]["programs"]) <= {s.key() for s in compiled}
  skewed = [r for r in d["rows"] if r["routing"] == "drift_bursts" and r["policy"] == "static"]
  assert skewed[0]["factor"] > 1.0     # its row was read between two buffers, each extrapolated


def test_the_denominator_is_static_eps_uniform_row(monkeypatch):
  """Picked as a policy's row is (the faster program that fits), the force-balanced step is
  static EP's own uniform row: here the grouped program is faster but does not fit."""
  def compile_row(spec, gpu="h100", hlo_dir=None):
    row = _program(spec)
    if "_einsum" in spec.kind:
      row["step_s"] *= 1.1
    else:
      row["fits"] = False
    if spec.kind.endswith(programs.RECOMPUTED):
      row["step_s"] *= 1.2
    return row

  monkeypatch.setattr(programs, "compile_row", compile_row)
  d = study.run(["mixtral_8x7b"], {"mixtral_8x7b": (8,)}, ["uniform"], ["static"],
                programs.Cache(None), study.GRID, 4, layers=2, log=lambda *_: None)
  den = d["denominators"]["mixtral_8x7b/8"]
  assert den["kernels"] == "einsum" and not den["exchange_recomputed"]
  assert not den["grouped"]["fits"] and den["einsum_recomputed"]["fits"]
  (row,) = d["rows"]
  assert row["kernels"] == "einsum" and row["fraction_of_balanced"] == pytest.approx(1.0)
  only = study.run(["mixtral_8x7b"], {"mixtral_8x7b": (8,)}, ["uniform"], ["static"],
                   programs.Cache(None), study.GRID, 4, layers=2, log=lambda *_: None,
                   kernels=("grouped",))
  assert only["denominators"]["mixtral_8x7b/8"]["kernels"] == "grouped"
  # Mixtral keeps its exchange, so the grouped program recomputing it was compiled too; where
  # neither fits, the faster is the row
  picked = only["rows"][0]
  assert picked["kernels"] == "grouped" and not picked["exchange_recomputed"]
  assert [(a["kernels"], a["exchange_recomputed"]) for a in picked["alternatives"]] == [
      ("grouped", True)]


def test_a_policys_row_is_its_faster_program_that_fits():
  """Of a policy's programs on the two kernels, the row is the fastest that fits (the
  fastest of all where none fits), the other kept under `alternatives`; one that did not
  compile is never picked over one that did."""
  def row(kernels, step, fits=True):
    return {"kernels": kernels, "needed_factor": 1.0, "factor": 1.0, "step_s": step,
            "fits": fits, "peak_gib": 1.0, "programs": [kernels]}

  assert study.faster([row("grouped", 2.0), row("einsum", 1.5)])["kernels"] == "einsum"
  picked = study.faster([row("grouped", 2.0), row("einsum", 1.5, fits=False)])
  assert picked["kernels"] == "grouped"
  assert picked["alternatives"][0]["kernels"] == "einsum"
  assert picked["alternatives"][0]["fits"] is False
  assert study.faster([row("grouped", 2.0, False), row("einsum", 3.0, False)])["step_s"] == 2.0
  failed = {"kernels": "einsum", "error": "no", "programs": ["x"]}
  assert study.faster([row("grouped", 2.0), failed])["kernels"] == "grouped"
  assert study.faster([row("grouped", 2.0)]) == row("grouped", 2.0)


def test_a_model_that_keeps_its_exchange_races_the_recomputing_programs(monkeypatch):
  """Mixtral's config keeps the MoE exchanges for the backward; each of its dense programs is
  compiled recomputing them too, and a row is the fastest of the four that fits: the kept one
  where it fits (here, at factor 1.0, where it is faster), the recomputing one where the kept
  buffers do not fit (the skewed routing's larger factor). Qwen3's config recomputes the
  exchange already: it has no such twins."""
  compiled = []

  def compile_row(spec, gpu="h100", hlo_dir=None):
    compiled.append(spec.kind)
    row = _program(spec)
    if spec.kind.endswith(programs.RECOMPUTED):
      row["step_s"] *= 1.1
    elif spec.factor > 1.0:
      row["peak_bytes"], row["fits"] = 1e12, False
    return row

  monkeypatch.setattr(programs, "compile_row", compile_row)
  d = study.run(["mixtral_8x7b"], {"mixtral_8x7b": (8,)}, ["uniform", "drift_bursts"],
                ["static"], programs.Cache(None), study.GRID, 12, layers=2,
                log=lambda *_: None)
  rows = {r["routing"]: r for r in d["rows"]}
  uniform, skewed = rows["uniform"], rows["drift_bursts"]
  assert not uniform["exchange_recomputed"] and uniform["fits"]
  assert uniform["fraction_of_balanced"] == pytest.approx(1.0)      # the denominator's pick
  assert skewed["factor"] > 1.0 and skewed["exchange_recomputed"] and skewed["fits"]
  for row in (uniform, skewed):
    assert sorted((a["kernels"], a["exchange_recomputed"]) for a in row["alternatives"]) == \
        sorted((k, r) for k in programs.KERNELS for r in (False, True)
               if (k, r) != (row["kernels"], row["exchange_recomputed"]))
  assert not any(a["fits"] for a in skewed["alternatives"] if not a["exchange_recomputed"])
  assert {"ep_recomputed", "ep_einsum_recomputed"} <= set(compiled)
  qwen3 = parse_config([programs.MODELS["qwen3_30b_a3b"]], ["data.path = None"])
  mixtral = study.Case.of("mixtral_8x7b", 8).cfg
  assert programs.keeps_exchange(mixtral) and not programs.keeps_exchange(qwen3)
  # fsep recomputes its layer in its own backward, so it keeps the exchange without remat too
  no_remat = dataclasses.replace(mixtral, model=dataclasses.replace(mixtral.model, remat=False))
  assert not programs.keeps_exchange(no_remat) and programs.keeps_exchange(no_remat, fsep=True)
  assert study.variants(study.Case.of("mixtral_8x7b", 8), "ragged", programs.KERNELS) == [
      ("grouped", False)]


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
  # the force-balanced step is static EP's faster program on uniform routing
  assert rows["uniform", "static"]["fraction_of_balanced"] == pytest.approx(1.0)
  # both kernels compiled, each keeping and recomputing the exchange (Mixtral's config keeps it)
  assert all(len(r["alternatives"]) == 3 for r in rows.values())
  skewed = rows["drift_bursts", "static"]
  assert skewed["needed_factor"] > 1.5 and skewed["fraction_of_balanced"] < 1.0
  fsep = rows["drift_bursts", "fsep_planned"]
  assert fsep["needed_factor"] < skewed["needed_factor"] and fsep["speedup_over_static"] > 1.0
  for p in d["programs"].values():
    assert p["compiled"] and p["spec"]["layers"] == 2 and p["compile_s"] > 0
