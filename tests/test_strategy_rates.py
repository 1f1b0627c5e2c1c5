"""The cost model's two matmul rates: dense dots and the grouped kernel of ragged dispatch
(decision 0058). Host only."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moejax.config import Config
from moejax.strategy.cost import PRESETS, load_profile, predict_step
from moejax.strategy.offline import workload_of
from moejax.strategy.spec import parse

W = workload_of(Config())


@pytest.mark.parametrize("name", ["h100_node", "h100_cluster", "h100_ep_node"])
def test_ragged_experts_run_at_the_grouped_rate(name):
  prof = PRESETS[name]
  assert 0 < prof.grouped_flops_per_s < prof.flops_per_s
  one_rate = dataclasses.replace(prof, grouped_flops_per_s=0.0)
  ragged = parse("ep/1x8x1/cf1/ragged")
  a, b = predict_step(ragged, W, prof), predict_step(ragged, W, one_rate)
  assert a.expert_s == pytest.approx(b.expert_s * prof.flops_per_s / prof.grouped_flops_per_s,
                                     rel=1e-12)
  assert (a.compute_s, a.a2a_s, a.memory_s) == (b.compute_s, b.a2a_s, b.memory_s)
  dense = parse("ep/1x8x1/cf1")      # capacity buffers: a batched dense dot
  assert predict_step(dense, W, prof).expert_s == predict_step(dense, W, one_rate).expert_s


def test_a_profile_json_without_the_grouped_rate_uses_one_rate(tmp_path):
  data = dataclasses.asdict(PRESETS["cpu"])
  del data["grouped_flops_per_s"]
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(data))
  prof = load_profile(str(path))
  assert prof.grouped_flops_per_s == 0.0
  assert prof.expert_flops_per_s("ragged") == prof.flops_per_s == PRESETS["cpu"].flops_per_s
