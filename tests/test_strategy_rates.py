"""The cost model's two matmul rates: dense dots and the grouped kernel (ragged dispatch,
decision 0058; per-slot buffers through moe.kernels = 'pallas'), and the search trying both
kernels for per-slot buffers on a GPU. Host only."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moejax.config import Config
from moejax.frontend import parse_config
from moejax.strategy.cost import PRESETS, load_profile, predict_step
from moejax.strategy.offline import rank, workload_of
from moejax.strategy.spec import from_config, parse, space

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
  assert prof.expert_flops_per_s(True) == prof.flops_per_s == PRESETS["cpu"].flops_per_s


def test_per_slot_buffers_are_priced_as_the_kernel_that_runs_them():
  prof = PRESETS["h100_node"]
  einsum, grouped = (predict_step(parse(f"ep/1x8x1/cf{cf}/{k}"), W, prof).expert_s
                     for cf, k in ((1, "xla"), (1, "pallas")))
  # At factor 1 the buffer holds the routed rows: the same rows, each kernel at its rate.
  assert grouped == pytest.approx(einsum * prof.flops_per_s / prof.grouped_flops_per_s,
                                  rel=1e-12)
  # XLA's einsum computes the whole buffer; the grouped kernel only the rows it holds.
  assert predict_step(parse("ep/1x8x1/cf2/xla"), W, prof).expert_s == pytest.approx(
      2 * einsum, rel=1e-2)
  assert predict_step(parse("ep/1x8x1/cf2/pallas"), W, prof).expert_s == grouped
  # either kernel's exchange moves, and its program holds, the whole buffer
  x, g = (predict_step(parse(f"ep/1x8x1/cf2/{k}"), W, prof) for k in ("xla", "pallas"))
  assert (x.a2a_s, x.memory_bytes) == (g.a2a_s, g.memory_bytes)
  assert x.memory_bytes > predict_step(parse("ep/1x8x1/cf1/xla"), W, prof).memory_bytes
  # A strategy without kernels is priced as the config's.
  pallas_w = dataclasses.replace(W, kernels="pallas")
  assert predict_step(parse("ep/1x8x1/cf2"), pallas_w, prof).expert_s == grouped
  pooled_w = dataclasses.replace(W, pooled=True)
  assert predict_step(parse("ep/1x8x1/cf2"), pooled_w, prof).expert_s == grouped


def test_a_strategy_names_its_kernels_and_sets_them():
  cfg = Config()
  s = parse("ep/8x8x1/cf1/xla/fsdp")
  assert (s.kernels, s.spec) == ("xla", "ep/8x8x1/cf1/xla/fsdp")
  assert parse("ep/1x8x1/cf1/pallas").apply(cfg).moe.kernels == "pallas"
  assert parse("ep/1x8x1/cf1").apply(cfg).moe.kernels == cfg.moe.kernels
  assert from_config(cfg, 8).kernels == ""         # the config's own, spec as before
  assert from_config(cfg, 8).spec == "ep/2x4x1/cf1.25"


def test_the_search_tries_both_kernels_on_a_gpu_and_picks_by_the_factor():
  cfg = parse_config(["configs/mixtral_8x7b.gin"], ["data.path = None"])
  assert cfg.moe.kernels == "pallas"
  assert {s.kernels for s in space(cfg, 64)} == {""}
  rows = {r.strategy.spec: r for r in rank(cfg, PRESETS["h100_ep_node"], 64)}
  assert {r.strategy.kernels for r in rows.values()} == {"", "xla"}
  cost = {spec: rows[spec].costs["uniform"].expert_s for spec in (
      "ep/8x8x1/cf1/fsdp", "ep/8x8x1/cf1/xla/fsdp", "ep/8x8x1/cf2/fsdp", "ep/8x8x1/cf2/xla/fsdp")}
  # Factor 1: the einsum's dense-dot rate pays; factor 2: its padding costs more than the
  # grouped kernel's lower rate.
  assert cost["ep/8x8x1/cf1/xla/fsdp"] < cost["ep/8x8x1/cf1/fsdp"]
  assert cost["ep/8x8x1/cf2/fsdp"] < cost["ep/8x8x1/cf2/xla/fsdp"]
  # The ragged and the CPU profile's searches keep the config's kernels.
  assert all(r.strategy.kernels == "" for r in rows.values() if r.strategy.dispatch == "ragged")
  assert {r.strategy.kernels for r in rank(cfg, PRESETS["cpu"], 64)} == {""}
