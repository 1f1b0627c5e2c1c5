"""Strategy space, step cost model and the offline pool pick: pure functions, known answers."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from moejax import plan as plan_cli
from moejax.config import Config, ConfigError, DataConfig, ModelConfig, MoEConfig
from moejax.strategy import offline
from moejax.strategy.cost import (
  PRESETS,
  expected_overflow,
  expert_shares,
  load_profile,
  predict_step,
)
from moejax.strategy.spec import Strategy, check_pool, factorizations, parse, space, why_invalid

CFG = Config()   # the default model: E=8, top-2, 4 heads, batch 16


@pytest.mark.parametrize("spec", ["ep/2x4x1/cf1.25", "fsep/1x8x1/c2/cf1.5", "ep/1x8x1/cf3/ragged"])
def test_spec_round_trips(spec):
  assert parse(spec).spec == spec


@pytest.mark.parametrize("bad", ["ep", "tp/2x4x1", "ep/2x4/cf1", "ep/2x4x1/zz", "ep/0x8x1"])
def test_bad_spec_is_one_line(bad):
  with pytest.raises(ConfigError) as e:
    parse(bad)
  assert "\n" not in str(e.value) and "e.g." in str(e.value)


def test_factorizations_cover_every_product():
  f = factorizations(8)
  assert len(f) == 10 and all(a * b * c == 8 for a, b, c in f) and len(set(f)) == 10


def test_why_invalid_names_the_reason():
  assert why_invalid(parse("ep/1x1x8/cf1"), CFG).startswith("model.num_heads=4")
  cfg3 = dataclasses.replace(CFG, moe=MoEConfig(num_experts=6))
  assert "divisible by expert axis" in why_invalid(parse("ep/2x4x1/cf1"), cfg3)
  assert why_invalid(parse("fsep/1x8x1/c0/cf1.25"), CFG) is None
  small_batch = dataclasses.replace(CFG, data=DataConfig(global_batch_size=4))
  assert "global_batch_size=4 is not divisible" in why_invalid(parse("ep/1x8x1/cf1"), small_batch)


def test_apply_sets_mesh_and_moe_and_mode_policy():
  cfg = dataclasses.replace(CFG, planner=dataclasses.replace(CFG.planner, policy="smartmoe"))
  out = parse("fsep/1x8x1/c3/cf1.5").apply(cfg)
  assert (out.mesh.data, out.mesh.expert, out.mesh.model) == (1, 8, 1)
  assert out.moe.expert_mode == "fsep" and out.moe.slots_per_device == 3
  assert out.moe.capacity_factor == 1.5 and out.planner.policy == "fsep"
  out.validate()


def test_space_has_no_duplicates_and_skips_fsep_without_expert_axis():
  s = space(CFG, 8)
  assert len(s) == len(set(s))
  assert not [x for x in s if x.expert_mode == "fsep" and x.expert == 1]


def test_strategy_config_errors_name_the_value():
  from moejax.config import StrategyConfig
  for bad, match in ((dict(every=-1), "strategy.every=-1"), (dict(max_drop=2.0), "max_drop=2.0"),
                     (dict(horizon=-3), "strategy.horizon=-3")):
    with pytest.raises(ConfigError, match=match):
      StrategyConfig(**bad).validate()


def test_check_pool_errors():
  with pytest.raises(ConfigError, match="uses 4 devices"):
    check_pool([parse("ep/1x4x1/cf1")], CFG, 8)
  with pytest.raises(ConfigError, match="at most 4"):
    check_pool([parse("ep/1x8x1/cf1")] * 5, CFG, 8)


def test_expected_overflow_matches_monte_carlo():
  rng = np.random.default_rng(0)
  for mean, cap in ((64.0, 64.0), (64.0, 80.0), (100.0, 50.0)):
    sim = np.maximum(rng.poisson(mean, 200_000) - cap, 0).mean()
    assert abs(float(expected_overflow(np.array([mean]), cap)[0]) - sim) < 0.1 * sim + 0.05


def test_dense_drops_grow_with_skew_and_fsep_absorbs_collapse():
  w = offline.workload_of(CFG)
  uni, col = offline.regime_load("uniform", 8), offline.regime_load("collapse", 8)
  ep = predict_step(parse("ep/1x8x1/cf1.25"), w, PRESETS["h100_node"], uni[None])
  ep_col = predict_step(parse("ep/1x8x1/cf1.25"), w, PRESETS["h100_node"], col[None])
  fs_col = predict_step(parse("fsep/1x8x1/c2/cf1.25"), w, PRESETS["h100_node"], col[None])
  assert ep.drop_fraction < 0.02 < 0.2 < ep_col.drop_fraction
  assert fs_col.drop_fraction < ep_col.drop_fraction / 4
  # Dense dispatch computes its capacity whatever the load; fsep pays for its restore.
  assert ep.expert_s == ep_col.expert_s and fs_col.restore_s > 0 == ep.restore_s


def test_load_dispersion_measures_clustered_sources_and_drops_follow_it():
  from moejax.strategy.cost import load_dispersion
  rng = np.random.default_rng(0)
  p = offline.regime_load("skewed", 8)
  independent = rng.multinomial(512, p, size=(4, 2, 8))            # [T, L, S, E]
  assert load_dispersion(independent) == pytest.approx(1.0, abs=0.15)
  # Tokens in clusters of 6 (a sequence repeating its tokens): variance ~6x the mean.
  clustered = 6 * rng.multinomial(512 // 6, p, size=(64, 2, 8))
  assert load_dispersion(clustered) == pytest.approx(6.0, rel=0.15)
  # Monte Carlo of the overflow with that variance.
  mean, var, cap = 64.0, 6 * 64.0, 80.0
  sim = np.maximum(rng.normal(mean, np.sqrt(var), 400_000) - cap, 0).mean()
  assert float(expected_overflow(np.array([mean]), cap, np.array([var]))[0]) == \
      pytest.approx(sim, rel=0.03)
  w = offline.workload_of(CFG)
  ep = parse("ep/1x8x1/cf1.25")
  uni = offline.regime_load("uniform", 8)[None]
  low = predict_step(ep, w, PRESETS["cpu"], uni).drop_fraction
  high = predict_step(ep, w, PRESETS["cpu"], uni, dispersion=6.5).drop_fraction
  assert low < 0.005 < 0.02 < high


def test_ragged_time_follows_the_busiest_device():
  w = offline.workload_of(CFG)
  s = parse("ep/1x8x1/cf1/ragged")
  uni = predict_step(s, w, PRESETS["h100_node"], offline.regime_load("uniform", 8)[None])
  col = predict_step(s, w, PRESETS["h100_node"], offline.regime_load("collapse", 8)[None])
  assert uni.drop_fraction == col.drop_fraction == 0.0
  np.testing.assert_allclose(col.expert_s / uni.expert_s,
                             8 * offline.regime_load("collapse", 8).max(), rtol=1e-6)


def test_more_devices_per_expert_group_cut_expert_memory():
  w = offline.workload_of(dataclasses.replace(CFG, model=ModelConfig(d_model=1024)))
  a = predict_step(parse("ep/8x1x1/cf1"), w, PRESETS["h100_node"])
  b = predict_step(parse("ep/1x8x1/cf1"), w, PRESETS["h100_node"])
  assert b.memory_bytes < a.memory_bytes


def test_pool_covers_each_regime_and_rejects_what_does_not_fit():
  rows = offline.rank(CFG, PRESETS["h100_node"], 8)
  pool = offline.pick_pool(rows, 3, 0.01)
  assert len(pool) == 3 == len(set(pool))
  # Members share one pipeline and FSDP choice (decision 0045): the first regime's best
  # sets it, and each regime's best (by the same score) among those sharing it is in the pool.
  first = min((r for r in rows if r.rejected is None), key=lambda r: r.score("uniform", 0.01))
  assert first.strategy == pool[0]
  for regime in offline.REGIMES:
    best = min((r for r in rows if r.rejected is None and
                offline.pipeline_of(r.strategy) == offline.pipeline_of(pool[0])),
               key=lambda r: r.score(regime, 0.01))
    assert best.strategy in pool
  tiny = dataclasses.replace(PRESETS["h100_node"], memory_bytes=1.0)
  assert all(r.rejected for r in offline.rank(CFG, tiny, 8))
  with pytest.raises(ConfigError):
    offline.pick_pool(offline.rank(CFG, tiny, 8), 2, 0.01)
  text = offline.table(rows)
  assert "POOL" in text and "rejected: model.num_heads=4" in text


def test_whole_step_fit_recovers_known_scales_and_leaves_absent_terms_alone():
  from moejax.strategy.profile_fit import fit_steps
  w, base = offline.workload_of(CFG), PRESETS["cpu"]
  specs = ["ep/8x1x1/cf1", "ep/1x8x1/cf1.25", "fsep/1x8x1/c2/cf1.5", "ep/2x2x2/cf1",
           "ep/1x4x2/cf2", "fsep/2x4x1/c2/cf1.25", "ep/4x2x1/cf3"]
  costs = [predict_step(parse(s), w, base) for s in specs]
  truth = dataclasses.replace(base, compute_scale=1.3, comm_scale=2.5, tp_scale=4.0,
                              overhead_s=0.2)
  measured = [predict_step(parse(s), w, truth).total_s for s in specs]
  fitted = fit_steps(base, costs, measured)
  for key in ("compute_scale", "comm_scale", "tp_scale", "overhead_s"):
    assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-6), key
  # No calibration strategy has a model axis: tp follows the other collectives.
  no_tp = [s for s in specs if s.split("/")[1].endswith("x1")]
  fitted = fit_steps(base, [predict_step(parse(s), w, base) for s in no_tp],
                     [predict_step(parse(s), w, truth).total_s for s in no_tp])
  assert fitted.tp_scale == fitted.comm_scale == pytest.approx(2.5, rel=1e-6)


def test_profiles_load_from_presets_and_json(tmp_path):
  assert load_profile("a100_cluster").name == "a100_cluster"
  path = tmp_path / "p.json"
  path.write_text(json.dumps(PRESETS["cpu"].to_dict()))
  assert load_profile(str(path)) == PRESETS["cpu"]
  result = tmp_path / "cost_model.json"            # a benchmarks/strategy/cost_model.py result
  result.write_text(json.dumps({"device": "cpu x8", "profile": PRESETS["a100_node"].to_dict()}))
  assert load_profile(str(result)) == PRESETS["a100_node"]
  with pytest.raises(ConfigError, match="moejax.calibrate"):
    load_profile(str(tmp_path / "missing.json"))


def test_plan_cli_prints_table_and_pool(tmp_path, capsys):
  out = tmp_path / "offline.json"
  assert plan_cli.main(["--profile", "h100_cluster", "--pool", "2", "--json", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "pool: " in printed and ("strategy.pool = [" in printed or "train with: " in printed)
  data = json.loads(out.read_text())
  assert len(data["pool"]) == 2
  in_pool = {r["strategy"] for r in data["rows"] if r["in_pool"]}
  assert in_pool == set(data["pool"]) and all(isinstance(parse(s), Strategy) for s in in_pool)
  assert plan_cli.main(["--profile", "nope"]) == 2
  # The flat pool (ep/8x1x1, 2.07 ms) over ep/1x1x4/p2/m2 (3.45 ms) once the reduce term
  # counts the program's calls (decisions 0051, 0055).
  assert "strategy.pool = [" in printed


def test_observed_regime_plans_for_the_measured_expert_shares(tmp_path, capsys):
  """A trained router is seldom even: under its measured shares ep at cf1.25 drops several
  times more than under even ones, so the pool's first member needs more capacity."""
  skew_E = np.array([0.17, 0.15, 0.14, 0.13, 0.12, 0.11, 0.10, 0.08])
  # The space without stages or FSDP (their candidates: tests/test_strategy_pipeline.py); a
  # pipeline member of one data*expert device has no gradient reduce to pay and wins here.
  flat = space(CFG, 8, stage_options=(1,), fsdp_options=(False,))
  even = offline.rank(CFG, PRESETS["h100_node"], 8, candidates=flat, dispersion=3.0)
  seen = offline.rank(CFG, PRESETS["h100_node"], 8, candidates=flat,
                      regimes=offline.OBSERVED_REGIMES, dispersion=3.0,
                      observed_LxE=skew_E[None])
  (e_drop,) = [r.costs["uniform"].drop_fraction for r in even if r.strategy.spec ==
               "ep/1x8x1/cf1.25"]
  (o_drop,) = [r.costs["observed"].drop_fraction for r in seen if r.strategy.spec ==
               "ep/1x8x1/cf1.25"]
  assert o_drop > 2 * e_drop
  assert offline.pick_pool(even, 2, 0.03)[0].capacity_factor == 1.25
  assert offline.pick_pool(seen, 2, 0.03, offline.OBSERVED_REGIMES)[0].capacity_factor == 1.5

  counts = np.zeros((3, 2, 8, 8), np.int32)      # [steps, MoE layers, sources, experts]
  counts[:] = np.round(skew_E * 1000).astype(np.int32)
  np.testing.assert_allclose(expert_shares(counts), np.tile(skew_E, (2, 1)), atol=1e-3)
  trace = tmp_path / "trace.npz"
  np.savez(trace, counts=counts)
  assert plan_cli.main(["--profile", "h100_node", "--pool", "2", "--max_drop", "0.03",
                    "--dispersion", "3", "--trace", str(trace), "--all"]) == 0
  printed = capsys.readouterr().out
  assert "observed ms" in printed and f"last 3 steps of {trace}" in printed
  flat_pool = "pool: ep/8x1x1/cf1.5" in printed
  np.savez(trace, counts=counts[..., :5])         # another model's trace: 5 experts
  assert plan_cli.main(["--profile", "h100_node", "--trace", str(trace)]) == 2
  err = capsys.readouterr().err
  assert "observed expert shares have shape (2, 5)" in err and "\n" not in err.strip()
  with pytest.raises(ConfigError, match="observed_LxE"):
    offline.regime_load("observed", 8)
  assert flat_pool   # ep/8x1x1 at its program's 11 reduce calls (decisions 0051, 0055)


def _switcher(every=10, max_drop=0.01, pool=("ep/1x8x1/cf1.25", "fsep/1x8x1/c2/cf1.25"),
              horizon=0):
  from moejax.config import StrategyConfig
  from moejax.strategy.switcher import StrategySwitcher
  return StrategySwitcher(StrategyConfig(pool=pool, every=every, max_drop=max_drop,
                                         horizon=horizon),
                          [parse(s) for s in pool], offline.workload_of(CFG), PRESETS["h100_node"])


def test_switcher_moves_to_fsep_when_ep_drops_and_back_when_load_evens():
  sw = _switcher()
  col, uni = offline.regime_load("collapse", 8)[None], offline.regime_load("uniform", 8)[None]
  d = sw.decide(0, col, {(0, 1): 1e9})   # the drop limit wins over any switch cost
  assert d is not None and d.target == 1 and d.reason == "drops"
  assert d.predicted_drop[0] > 0.01 and d.predicted_drop[1] < d.predicted_drop[0] / 4
  assert sw.decide(1, col, {}) is None                   # already on the best member
  back = sw.decide(1, uni, {(1, 0): 0.0})                # ep is faster at even load
  assert back is not None and back.target == 0 and back.reason == "time" and back.gain_s > 0
  assert sw.decide(1, uni, {(1, 0): back.gain_s * 2}) is None   # not worth its cost


def test_switcher_believes_measured_drops_and_needs_the_round_trip_paid():
  sw = _switcher()
  uni = offline.regime_load("uniform", 8)[None]
  assert sw.decide(0, uni, {}, measured_drop=0.001) is None    # ep is best at even load
  # ep drops 4% here (clustered tokens). fsep was never measured under this load, so it is
  # taken to miss the model by as much: no switch on paper alone.
  assert sw.decide(0, uni, {(0, 1): 0.0}, measured_drop=0.04) is None
  # Once fsep is measured here at 0.1%, ep's 4% is left, and fsep is not left again at once.
  assert sw.decide(1, uni, {}, measured_drop=0.001) is None
  d = sw.decide(0, uni, {(0, 1): 1e9}, measured_drop=0.04)
  assert d is not None and d.target == 1 and d.reason == "drops"
  assert d.predicted_drop[0] >= 0.04 > 0.002 > d.predicted_drop[1]
  assert sw.decide(1, uni, {(1, 0): 0.0, (0, 1): 0.0}, measured_drop=0.001) is None
  # A time switch must pay for going there and back.
  fresh = _switcher()
  back = fresh.decide(1, uni, {})
  assert back is not None and back.reason == "time"
  half = back.gain_s / 2 * 1.01
  assert fresh.decide(1, uni, {(1, 0): half, (0, 1): half}) is None
  assert fresh.decide(1, uni, {(1, 0): half, (0, 1): 0.0}) is not None


def test_switcher_lends_the_running_members_drop_excess_to_unmeasured_ones():
  sw = _switcher(max_drop=0.03)
  col, uni = offline.regime_load("collapse", 8)[None], offline.regime_load("uniform", 8)[None]
  model = [c.drop_fraction for c in sw.predict(col)]
  # ep under a collapse drops 20 points over the model: fsep, unmeasured there, is given
  # them too, and still drops less.
  d = sw.decide(0, col, {(0, 1): 1e9}, measured_drop=model[0] + 0.2)
  assert d is not None and d.target == 1 and d.reason == "drops"
  np.testing.assert_allclose(d.predicted_drop, np.array(model) + 0.2)
  # A member's own excess counts once measured, remembered per load: ep's small one from the
  # even load before the collapse outlives the collapse.
  sw = _switcher(max_drop=0.03)
  assert sw.decide(0, uni, {}, measured_drop=0.01) is None
  sw.decide(0, col, {(0, 1): 0.0}, measured_drop=model[0])
  d = sw.decide(1, uni, {(1, 0): 0.0}, measured_drop=0.3)   # fsep's stale replicas
  assert d is not None and d.target == 0 and d.reason == "drops"
  assert d.predicted_drop[0] == pytest.approx(0.01) and d.predicted_drop[1] >= 0.3


def test_switcher_forgets_a_drop_excess_seen_under_another_load():
  sw = _switcher()
  col, uni = offline.regime_load("collapse", 8)[None], offline.regime_load("uniform", 8)[None]
  assert sw.decide(0, uni, {}, measured_drop=0.005) is None   # ep measured at even load
  # fsep's replicas still serve a gone hot expert: at even load it drops 30% for a while.
  d = sw.decide(1, uni, {(1, 0): 0.0}, measured_drop=0.3)
  assert d is not None and d.target == 0 and d.reason == "drops"
  assert d.predicted_drop[1] >= 0.3                     # believed while the load stays even
  again = sw.decide(0, uni * 0.98 + col * 0.02, {})       # about the same load: still believed
  assert again is None
  # The next collapse: that excess says nothing of fsep's re-planned replicas under it.
  d = sw.decide(0, col, {(0, 1): 1e9})
  assert d is not None and d.target == 1 and d.reason == "drops"
  assert d.predicted_drop[1] == sw.predict(col)[1].drop_fraction < d.predicted_drop[0] / 4


def test_switcher_believes_the_median_excess_so_one_spike_moves_nothing():
  sw = _switcher(max_drop=0.03)
  uni = offline.regime_load("uniform", 8)[None]
  never = {(0, 1): 1e9, (1, 0): 1e9}                     # no time switch can pay
  assert sw.decide(0, uni, never, measured_drop=0.02) is None
  assert sw.decide(1, uni, never, measured_drop=0.02) is None    # fsep measured here too
  assert sw.decide(0, uni, never, measured_drop=0.02) is None
  assert sw.decide(0, uni, never, measured_drop=0.08) is None    # one spike: median 2%
  d = sw.decide(0, uni, never, measured_drop=0.08)               # two: median 8%
  assert d is not None and d.target == 1 and d.reason == "drops"
  assert d.predicted_drop[0] == pytest.approx(0.08) and d.predicted_drop[1] < 0.03


def test_switcher_counts_near_drops_as_equal_and_pays_a_switch_over_the_horizon():
  uni = offline.regime_load("uniform", 8)[None]
  # Both over the limit by as much (fsep measured 5%, ep given that miss): neither is
  # better on drops, so the faster one wins on time.
  d = _switcher(every=1).decide(1, uni, {(1, 0): 0.0, (0, 1): 0.0}, measured_drop=0.05)
  assert d is not None and d.target == 0 and d.reason == "time"
  assert min(d.predicted_drop) > 0.01 and abs(d.predicted_drop[0] - d.predicted_drop[1]) < 0.01
  # Half again the fewest drops is as good too: ep's 3.5% against fsep's measured 2.4%.
  sw = _switcher(max_drop=0.03)
  never = {(0, 1): 1e9, (1, 0): 1e9}
  assert sw.decide(1, uni, never, measured_drop=0.024) is None
  assert sw.decide(0, uni, never, measured_drop=0.035) is None
  d = sw.decide(0, uni, never, measured_drop=0.05)     # median of 3.5% and 5%: 4.25% is not
  assert d is not None and d.target == 1 and d.reason == "drops"
  assert d.predicted_drop[0] == pytest.approx(0.0425)
  # A time switch pays its round trip over `horizon` steps (default: `every`).
  gain_per_step = _switcher(every=1).decide(1, uni, {}).gain_s
  cost = {(1, 0): gain_per_step * 0.75, (0, 1): gain_per_step * 0.75}
  assert _switcher(every=1).decide(1, uni, cost) is None
  d = _switcher(every=1, horizon=2).decide(1, uni, cost)
  assert d is not None and d.gain_s == pytest.approx(2 * gain_per_step)


def test_switcher_keys_a_remembered_excess_by_the_load_first_seen():
  sw = _switcher()
  col, uni = offline.regime_load("collapse", 8)[None], offline.regime_load("uniform", 8)[None]

  def toward_collapse(tv):   # a load at total variation distance `tv` from the even one
    return uni + (col - uni) * tv / (0.5 * np.abs(col - uni).sum())

  sw.decide(1, uni, {(1, 0): 1e9}, measured_drop=0.3)
  sw.decide(1, toward_collapse(0.08), {(1, 0): 1e9}, measured_drop=0.3)   # same load, 2 samples
  assert len(sw.drop_excess[1]) == 1 and sw._excess(1, toward_collapse(0.09)) is not None
  assert sw._excess(1, toward_collapse(0.16)) is None   # 0.16 from the load first seen


def test_switcher_leaves_ep_when_the_measured_spread_predicts_its_drops():
  uni = offline.regime_load("uniform", 8)[None]
  pool = ("ep/1x8x1/cf1.25", "ep/1x8x1/cf2")
  assert _switcher(pool=pool).decide(0, uni, {}, dispersion=1.0) is None
  d = _switcher(pool=pool).decide(0, uni, {(0, 1): 1e9}, dispersion=6.5)
  assert d is not None and d.target == 1 and d.reason == "drops"
  assert d.predicted_drop[0] > 0.02 > 0.01 > d.predicted_drop[1]


def test_switcher_due_and_shares():
  from moejax.strategy.switcher import expert_shares
  sw = _switcher(every=5)
  assert [s for s in range(12) if sw.due(s)] == [5, 10]
  assert not _switcher(every=5, pool=("ep/1x8x1/cf1.25",)).due(5)
  h = np.zeros((3, 2, 4, 8))
  h[..., 0] = 3.0
  h[..., 1] = 1.0
  np.testing.assert_allclose(expert_shares(h)[:, :2], [[0.75, 0.25]] * 2)
