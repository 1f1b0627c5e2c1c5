"""benchmarks.layer.balance_pays's host side at tiny shapes: plans from warm-up batches, the
smallest factors that keep a different batch's drops <= 1%, and the ratios it reports. (The
benchmark itself stops when a compiled layer's drops differ from the prediction checked here;
compiling its four layer programs would take this suite past its time budget.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.layer import balance_pays, balance_setup as setup
from benchmarks.layer.fsep_vs_ep import routed_counts
from moejax.layout import capacity

N, E, K, D, TOKENS = 8, 16, 2, 64, 256


def _counts(rng, router):
  x = rng.standard_normal((N * TOKENS // 128, 128, D))
  x[..., 0] = 4.0
  return routed_counts(x.astype(np.float32), router, K, N)


@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_policies_need_smaller_buffers_at_most_one_percent_dropped(seed):
  rng = np.random.default_rng(seed)
  router = 0.05 * rng.standard_normal((D, E)).astype(np.float32)
  router[0] = setup.log_popularity(seed, E, 1.0) / 4.0
  warm = np.stack([_counts(rng, router) for _ in range(3)])
  timed_WxE = _counts(rng, router)
  args = balance_pays.parse_args(["--d_model", str(D), "--d_ff", "64", "--experts", str(E)])
  plans = setup.plan(warm, N, 4, balance_pays.layer_config(args))
  factor = {}
  for policy in setup.POLICIES:
    p = plans[policy]
    factor[policy] = setup.needed_factor(policy, p, timed_WxE[None], TOKENS, K)
    dropped = setup.predicted_dropped(policy, p, timed_WxE, TOKENS, K, factor[policy])
    assert dropped <= setup.MAX_DROPPED * timed_WxE.sum()
    # One buffer row fewer would drop more than 1%: the factor is the smallest.
    mode = setup.CAPACITY[policy]
    rows = capacity.rows(mode, TOKENS, K, N, p.slots_per_device, factor[policy])
    assert capacity.dropped(mode, setup.slot_loads(p, timed_WxE), p.slots_per_device,
                            rows - 1) > setup.MAX_DROPPED * timed_WxE.sum()
    layout = setup.device_layout(policy, [p], E)
    assert layout.expert_slots_LxExR.shape[-1] == (N if policy == "fsep" else 1)
  assert factor["static_pooled"] <= factor["static"]
  assert factor["smartmoe"] < factor["static"] and factor["fsep"] < factor["static"]


def test_ratios_per_seed_geomean_and_per_round():
  rows = []
  for seed, speed in ((0, 2.0), (1, 8.0)):
    for i, policy in enumerate(setup.POLICIES):
      times = [1.0 / (1 + i * speed / 8), 2.0 / (1 + i * speed / 8)]
      rows.append({"policy": policy, "seed": seed, "tokens_per_s": 10.0 * (1 + i * speed / 8),
                   "layer_times_s": times})
  ratios, per_round = balance_pays._ratios(rows, [0, 1])
  assert set(ratios) == {f"{p}/tokens_per_s" for p in setup.POLICIES[1:]}
  fsep = ratios["fsep/tokens_per_s"]
  assert fsep["per_seed"] == pytest.approx([1.75, 4.0])
  assert fsep["geomean"] == pytest.approx(math.sqrt(1.75 * 4.0))
  assert np.allclose(per_round["fsep/tokens_per_s"], [[1.75, 1.75], [4.0, 4.0]])
  quick = balance_pays.parse_args(["--quick"])
  assert quick.seeds == [0] and quick.rounds == 4 and quick.step


def test_fsep_plan_needs_no_bigger_buffer_than_a_level_one_on_the_benchmark_setup():
  """On balance_pays' own seed-0 layer routing (full size: 8 x 2048 tokens, E = 16, top-2),
  the trainer's fsep re-planner with its default options (pooled capacity as the benchmark
  runs it, locality on, spread planning) needs capacity factor <= 1.1 for <= 1% drops on the
  timed batch: keeping a device's tokens home must not pile rows onto its own pair's buffer."""
  args = balance_pays.parse_args([])
  _, warm, _, timed_WxE = balance_pays.layer_setup(args, 0)
  base = balance_pays.layer_config(args)
  p = setup.plan(warm, N, args.fsep_slots, base)["fsep"]
  assert p.local is not None, "the default options plan per-source shares"
  factor = setup.needed_factor("fsep", p, timed_WxE[None], args.tokens_per_device, K)
  assert factor <= 1.1, factor
