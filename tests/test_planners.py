"""Planners are pure functions: hand-made loads with known optima."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.layout import host_layout as placement_lib
from moejax.layout.flow import flow, max_over_mean
from moejax.placement import policies, shadow, smartmoe
from moejax.placement.synthetic import synthetic_trace
from tests.plan_helpers import PLAN_COST


def _dev_loads(p: placement_lib.Placement, load_E):
  return np.bincount(p.device_of_slot, weights=np.asarray(load_E, float)[p.slot_expert],
                     minlength=p.num_devices)


def _permute(load_E, current, **options):
  return smartmoe.place_permutation(load_E[None], current,
                                    options=smartmoe.SmartMoEOptions(**options))


def test_static_places_expert_e_on_device_e_div_c():
  p = policies.get_policy("static")(np.ones((4, 8)), placement_lib.static(8, 4))
  np.testing.assert_array_equal(p.device_of_slot[np.argsort(p.slot_expert)], np.arange(8) // 2)


def test_smartmoe_finds_the_known_optimum():
  load_E = np.array([8, 7, 6, 5, 4, 3, 2, 1], float)    # best: pairs summing to 9
  p = _permute(load_E, placement_lib.static(8, 4), min_gain=0.0)
  assert sorted(np.bincount(p.device_of_slot[p.slot_expert >= 0], minlength=4)) == [2] * 4
  np.testing.assert_array_equal(_dev_loads(p, load_E), [9, 9, 9, 9])
  assert sorted(p.slot_expert.tolist()) == list(range(8))


def test_smartmoe_keeps_a_balanced_placement():
  load_E = np.array([8, 1, 7, 2, 6, 3, 5, 4], float)    # static is already optimal
  cur = placement_lib.static(8, 4)
  assert _permute(load_E, cur) is cur


def test_smartmoe_hysteresis_rejects_small_gains():
  load_E = np.array([5.2, 5, 5, 5, 5, 5, 5, 4.8])        # best possible gain ~2%
  cur = placement_lib.static(8, 4)
  assert _permute(load_E, cur, min_gain=0.05) is cur


def test_smartmoe_keeps_slots_of_experts_that_stay():
  cur = placement_lib.one_copy(np.array([0, 1, 2, 3, 4, 5, 6, 7]), 4)
  load_E = np.array([10, 10, 1, 1, 1, 1, 1, 1], float)   # only experts 0/1 must split
  new = _permute(load_E, cur, min_gain=0.0)
  dev_new = new.device_of_slot[np.argsort(new.slot_expert)]
  stayed = np.flatnonzero(dev_new == np.arange(8) // 2)
  for e in stayed:
    assert new.slot_expert[e] == e, f"expert {e} stayed on its device but changed slot"
  assert dev_new[0] != dev_new[1]


def test_smartmoe_never_worse_than_current_on_random_loads():
  rng = np.random.default_rng(0)
  for _ in range(50):
    load_E = rng.lognormal(0, 1.5, 16)
    cur = placement_lib.one_copy(rng.permutation(16), 4)
    new = _permute(load_E, cur, min_gain=0.0)
    cur_peak = _dev_loads(cur, load_E).max()
    assert _dev_loads(new, load_E).max() <= cur_peak * (1 + 1e-12)   # float sums may differ


def test_smartmoe_rejects_indivisible_experts():
  with pytest.raises(ConfigError, match="divisible"):
    smartmoe.place_permutation(
        np.ones((1, 6)), placement_lib.Placement(np.arange(6, dtype=np.int32), np.ones(6), 4))


def _collapsed(devices=4, experts=8, hot_share=0.5, tokens=4000):
  load = np.full(experts, (1 - hot_share) / (experts - 1))
  load[3] = hot_share
  return np.tile(load * tokens / devices, (devices, 1))    # every device sends the same mix


def test_shadow_replicates_a_collapsed_expert_when_cheap():
  pred = _collapsed()
  src = np.arange(4)
  cheap = dataclasses.replace(PLAN_COST, link_bytes_per_s=1e15)
  p = shadow.place_shadows(pred, placement_lib.static(8, 4), slots=3, src_dev_W=src, cost=cheap)
  p.validate(8)
  assert p.replicas(8)[3] == 4 and p.replicas(8).sum() == 8 + 3
  assert max_over_mean(flow(p, pred, src).device_load_N) < 1.3
  assert max_over_mean(flow(placement_lib.static(8, 4), pred, src).device_load_N) > 1.9


def test_shadow_stays_static_when_sync_is_expensive():
  pred = _collapsed()
  costly = dataclasses.replace(PLAN_COST, d_model=4096, d_ff=16384, link_bytes_per_s=1e6)
  p = shadow.place_shadows(pred, placement_lib.static(8, 4), slots=3, src_dev_W=np.arange(4),
                           cost=costly)
  np.testing.assert_array_equal(p.slot_expert[p.slot_expert >= 0], np.arange(8))


def test_local_first_routing_and_quotas():
  # Expert 0 has slots on devices 0 and 1 (shares 0.5 / 0.5); expert 1 only on device 1.
  p = placement_lib.Placement(np.array([0, -1, 0, 1], np.int32), np.array([0.5, 0, 0.5, 1.0]), 2)
  p.validate(2)
  counts_WxE = np.array([[6, 1], [2, 3]])   # source s on device s
  slot_load, sent_WxN = placement_lib.route(p, counts_WxE, np.arange(2))
  np.testing.assert_array_equal(slot_load, [4, 0, 4, 4])
  # Source 0: 4 of its 6 expert-0 tokens stay local (quota 4), 2 go to device 1; its expert-1
  # token goes to device 1. Source 1: its 2 expert-0 tokens stay local, 3 expert-1 local.
  np.testing.assert_array_equal(sent_WxN, [[4, 3], [0, 5]])
  assert placement_lib.crossing(sent_WxN, np.arange(2)) == 3


def test_quotas_sum_exactly_to_the_totals():
  rng = np.random.default_rng(1)
  p = placement_lib.Placement(np.array([0, 0, 0, 1], np.int32), np.array([0.3, 0.3, 0.4, 1.0]), 2)
  for _ in range(20):
    totals = rng.integers(0, 1000, 2)
    q = placement_lib.quotas(p, totals)
    assert q[:3].sum() == totals[0] and q[3] == totals[1]


def test_bad_placements_and_sources_are_rejected():
  with pytest.raises(ConfigError, match="no copy"):
    placement_lib.one_copy(np.array([0, 0, 1, 1]), 2).validate(3)
  with pytest.raises(ConfigError, match="sum to"):
    placement_lib.Placement(np.array([0, 1], np.int32), np.array([0.5, 1.0]), 2).validate(2)
  with pytest.raises(ConfigError, match="evenly"):
    placement_lib.source_devices(3, 2)
  with pytest.raises(ConfigError, match="unknown"):
    policies.get_policy("nope")


def test_an_unknown_policy_option_is_a_one_line_error_naming_the_valid_ones():
  assert policies.make_options("smartmoe", min_gain=0.1) == smartmoe.SmartMoEOptions(0.1)
  for name, bad in (("smartmoe", "min_gian"), ("fsep", "capacity_mode"), ("static", "min_gain"),
                    ("shadow", "slots")):
    with pytest.raises(ConfigError) as e:
      policies.make_options(name, **{bad: 1})
    msg = str(e.value)
    assert repr(bad) in msg and name in msg and "\n" not in msg, msg
  with pytest.raises(ConfigError, match="min_gain, max_swap_iters"):
    policies.make_options("smartmoe", min_gian=0.1)
  with pytest.raises(ConfigError, match="unknown"):
    policies.make_options("nope")


def test_smartmoe_is_never_predicted_worse_than_static():
  rng = np.random.default_rng(3)
  for _ in range(50):
    load_E = rng.lognormal(0, 1.5, 16)
    cur = placement_lib.one_copy(rng.permutation(16), 4)            # whatever the current layout is
    new = _permute(load_E, cur, min_gain=0.2)  # even with strong hysteresis
    static_peak = _dev_loads(placement_lib.static(16, 4), load_E).max()
    assert _dev_loads(new, load_E).max() <= static_peak * (1 + 1e-12)


def test_smartmoe_under_pooled_capacity_pairs_experts_whose_loads_alternate():
  """Experts 0 and 2 take turns being hot, 1 and 3 are steady: every expert's mean load is the
  same, so the busiest-device score sees nothing to gain, but the static pairs (0, 1), (2, 3)
  overflow a device on every step while (0, 2), (1, 3) never do."""
  z = np.arange(10) % 2
  hot_steps, cold_steps = np.where(z, 30, 10), np.where(z, 10, 30)
  steady_steps = np.full(10, 20)
  samples_stepsxWxE = np.stack([hot_steps, steady_steps, cold_steps, steady_steps],
                               -1)[:, None, :].repeat(2, 1)
  static = placement_lib.static(4, 2)
  pred_WxE = samples_stepsxWxE.mean(0)
  by_peak = smartmoe.place_permutation(pred_WxE, static)
  assert np.array_equal(by_peak.slot_expert, static.slot_expert)
  options = smartmoe.SmartMoEOptions(pooled_capacity_factor=1.0)
  by_drops = smartmoe.place_permutation(pred_WxE, static, options=options,
                                        samples_stepsxWxE=samples_stepsxWxE)
  dev_E = lambda p: p.device_of_slot[np.argsort(p.slot_expert)]
  cap_stepsxW = np.full((10, 2), 40.0)      # cf 1.0 x 80 choices per source / 2 devices
  assert smartmoe.pooled_drops(samples_stepsxWxE, dev_E(static), 2, cap_stepsxW) == 200
  assert smartmoe.pooled_drops(samples_stepsxWxE, dev_E(by_drops), 2, cap_stepsxW) == 0
  assert dev_E(by_drops)[0] == dev_E(by_drops)[2]
  # Without samples the option has nothing to score and the peak rule applies.
  assert np.array_equal(smartmoe.place_permutation(pred_WxE, static, options=options).slot_expert,
                        static.slot_expert)


def _full_scan_gains(samples_stepsxWxE, dev_E, n, cap_stepsxW):
  """[E, E]: the drops each pair swap would save, from a scan of every E x E pair."""
  s_ExstepsxW = np.moveaxis(samples_stepsxWxE, -1, 0)
  load_NxstepsxW = np.moveaxis(samples_stepsxWxE @ np.eye(n)[dev_E], -1, 0)
  drop_N = np.maximum(load_NxstepsxW - cap_stepsxW, 0).sum((1, 2))
  delta_ExExstepsxW = s_ExstepsxW[None] - s_ExstepsxW[:, None]
  at_a = np.maximum(load_NxstepsxW[dev_E][:, None] + delta_ExExstepsxW - cap_stepsxW,
                    0).sum((2, 3))
  at_b = np.maximum(load_NxstepsxW[dev_E][None, :] - delta_ExExstepsxW - cap_stepsxW,
                    0).sum((2, 3))
  gain_ExE = drop_N[dev_E][:, None] + drop_N[dev_E][None, :] - at_a - at_b
  gain_ExE[dev_E[:, None] == dev_E[None, :]] = 0
  return gain_ExE


@pytest.mark.parametrize("experts,devices,seed", [(16, 4, 0), (16, 8, 1), (32, 8, 2),
                                                   (24, 6, 3), (32, 4, 4)])
def test_pooled_drop_swaps_end_where_no_pair_swap_gains(experts, devices, seed, monkeypatch):
  """The search from the dropping devices (the whole-scan path turned off), where its budget
  covers every pair: the swaps stop at a local optimum of the full E x E pair scan (no swap
  lowers the drops), below the start's drops, with E/N per device."""
  monkeypatch.setattr(smartmoe, "_FULL_ROWS", 0)
  rng = np.random.default_rng(seed)
  samples = synthetic_trace(6, 1, devices, experts, kind="lognormal", seed=seed,
                            tokens_per_source=256)["counts"][:, 0].astype(np.float64)
  cap_stepsxW = np.ceil(1.1 * samples.sum(-1) / devices)
  start = rng.permutation(np.arange(experts) // (experts // devices))
  got = smartmoe._swaps_for_drops(samples, start, devices, cap_stepsxW, 4 * experts)
  assert np.all(np.bincount(got, minlength=devices) == experts // devices)
  assert _full_scan_gains(samples, got, devices, cap_stepsxW).max() <= 1e-9
  assert smartmoe.pooled_drops(samples, got, devices, cap_stepsxW) < \
      smartmoe.pooled_drops(samples, start, devices, cap_stepsxW)
  assert smartmoe.pooled_drops(samples, got, devices, cap_stepsxW) == \
      np.maximum(samples @ np.eye(devices)[got] - cap_stepsxW[..., None], 0).sum()


def _swaps_by_full_scan(samples_stepsxWxE, dev_E, n, cap_stepsxW, max_iters):
  """Each round the pair with the largest gain of the full scan, the first in row-major order."""
  dev_E = dev_E.copy()
  for _ in range(max_iters):
    gain_ExE = _full_scan_gains(samples_stepsxWxE, dev_E, n, cap_stepsxW)
    a, b = np.unravel_index(np.argmax(gain_ExE), gain_ExE.shape)
    if gain_ExE[a, b] <= 1e-9:
      break
    dev_E[a], dev_E[b] = dev_E[b], dev_E[a]
  return dev_E


@pytest.mark.parametrize("experts,devices,seed", [(16, 4, 0), (32, 8, 2), (24, 6, 3)])
def test_pooled_drop_swaps_at_small_e_equal_the_full_pair_scan(experts, devices, seed):
  """Where the whole E x E scan fits its bound, the swaps are the scan's, pair by pair."""
  rng = np.random.default_rng(seed)
  samples = synthetic_trace(6, 1, devices, experts, kind="lognormal", seed=seed,
                            tokens_per_source=256)["counts"][:, 0].astype(np.float64)
  cap_stepsxW = np.ceil(1.1 * samples.sum(-1) / devices)
  start = rng.permutation(np.arange(experts) // (experts // devices))
  assert experts * experts * samples[..., 0].size <= smartmoe._FULL_ROWS
  np.testing.assert_array_equal(
      smartmoe._swaps_for_drops(samples, start, devices, cap_stepsxW, 4 * experts),
      _swaps_by_full_scan(samples, start, devices, cap_stepsxW, 4 * experts))
