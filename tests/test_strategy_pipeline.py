"""Pipeline stages, microbatches and FSDP in the strategy space, the cost model and the
memory model: pure functions, known answers (host only)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moejax.config import Config, ConfigError, DataConfig, StrategyConfig
from moejax.strategy import stages
from moejax.strategy.cost import PRESETS, predict_step
from moejax.strategy.offline import workload_of
from moejax.strategy.spec import check_pool, from_config, parse, space, why_invalid

CFG = Config()   # the default model (slot capacity): 2 layer groups, batch 16
# h100_node's rates with no fixed costs and nothing overlapped: terms add up by hand.
FREE = dataclasses.replace(PRESETS["h100_node"], latency_s=0.0, overhead_s=0.0,
                           overlap_param_comm=False)


@pytest.mark.parametrize("spec", ["ep/1x4x1/p2/m8/cf1.25", "ep/2x2x1/p2/v2/m4/cf1/fsdp",
                                  "fsep/2x4x1/c2/cf1.5/ragged/fsdp", "ep/2x4x1/cf1.25"])
def test_pipeline_specs_round_trip(spec):
  s = parse(spec)
  assert s.spec == spec and parse(s.spec) == s


def test_pipeline_spec_fields_and_errors():
  s = parse("ep/1x4x1/p2/m8/cf1.25/fsdp")
  assert (s.stage, s.microbatches, s.virtual, s.fsdp, s.num_devices) == (2, 8, 1, True, 8)
  for bad in ("ep/1x4x1/p0/cf1", "ep/1x4x1/m0/cf1", "ep/1x4x1/px/cf1", "ep/1x4x1/fsdp2"):
    with pytest.raises(ConfigError) as e:
      parse(bad)
    assert "\n" not in str(e.value) and "e.g." in str(e.value)


def test_apply_and_from_config_carry_the_pipeline():
  cfg = parse("ep/1x4x1/p2/m4/cf1.25/fsdp").apply(CFG).validate()
  assert (cfg.mesh.stage, cfg.train.microbatches, cfg.mesh.fsdp) == (2, 4, True)
  assert (cfg.mesh.data, cfg.mesh.expert, cfg.mesh.model) == (1, 4, 1)
  assert from_config(cfg, 8) == parse("ep/1x4x1/p2/m4/cf1.25/fsdp")


def test_bubble_of_gpipe_and_circular():
  assert stages.bubble_fraction(1, 8) == 0.0 and stages.stretch(1, 8) == 1.0
  assert stages.bubble_fraction(4, 4) == pytest.approx(3 / 7)              # GPipe
  assert stages.bubble_fraction(4, 4, virtual=2) == pytest.approx(3 / 11)  # circular
  for p, m, v in ((2, 4, 1), (4, 16, 8), (4, 4, 2)):
    assert stages.stretch(p, m, v) == pytest.approx(1 / (1 - stages.bubble_fraction(p, m, v)))
  assert stages.stage_of_group(8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
  assert stages.stage_of_group(8, 2, virtual=2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
  assert stages.busiest_stage(np.array([1.0, 1, 5, 1]), 2) == 6.0


def test_stage_work_is_its_layers_stretched_by_the_bubble():
  """Same devices per stage, same tokens per device: a stage computes half the layers for
  (M + P - 1) / M of the ticks (ragged dispatch: expert rows follow the load exactly)."""
  w = workload_of(CFG)
  one = predict_step(parse("ep/1x4x1/cf1/ragged"), w, FREE)
  two = predict_step(parse("ep/1x4x1/p2/m4/cf1/ragged"), w, FREE)
  assert two.bubble == pytest.approx(1 / 5)
  assert two.expert_s / one.expert_s == pytest.approx(stages.stretch(2, 4) / 2)
  # A hot layer on stage 1 sets the pace: its expert rows are the busiest stage's.
  hot = np.full((2, 8), 1 / 8)
  hot[1] = [0.65] + [0.05] * 7
  skew = predict_step(parse("ep/1x4x1/p2/m4/cf1/ragged"), w, FREE, hot)
  assert skew.expert_s > two.expert_s * 1.5
  # Stage sends: per tick the rotation of one device's microbatch rows (forward and back);
  # once a step the last rotation and two all-reduces of all four microbatches over 2 stages.
  tokens = 16 * 128 / 4
  send = tokens / 4 * w.d_model * w.act_bytes / FREE.a2a_bytes_per_s
  assert two.pipe_s == pytest.approx((2 * stages.ticks(2, 4) + 2) * send + 2 * (4 * send))
  assert one.pipe_s == 0.0


def test_memory_and_state_split_over_stages_and_fsdp():
  w = workload_of(dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, d_model=512)))
  base = predict_step(parse("ep/2x4x1/cf1.25"), w, FREE)
  fsdp = predict_step(parse("ep/2x4x1/cf1.25/fsdp"), w, FREE)
  assert fsdp.state_bytes == pytest.approx(base.state_bytes / 2)   # everything over data=2
  assert fsdp.memory_bytes < base.memory_bytes
  one = predict_step(parse("ep/1x4x1/cf1.25"), w, FREE)
  two = predict_step(parse("ep/1x4x1/p2/m2/cf1.25"), w, FREE)
  embed_head = 3 * 4 * 2 * w.vocab_size * w.d_model          # on every stage
  assert two.state_bytes - embed_head == pytest.approx((one.state_bytes - embed_head) / 2)
  # FSDP pays its gathers: more parameter traffic than the plain gradient reduce.
  assert fsdp.reduce_s > base.reduce_s


def test_remat_keeps_group_inputs_only():
  w = workload_of(dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, d_model=512)))
  s = parse("ep/1x4x1/p2/m4/cf1.25")
  plain = predict_step(s, w, FREE)
  remat = predict_step(s, dataclasses.replace(w, remat=True), FREE)
  assert remat.memory_bytes < plain.memory_bytes
  assert remat.compute_s > plain.compute_s                  # the forward runs twice


def test_gpu_presets_overlap_the_gradient_reduce_and_cpu_does_not():
  w = workload_of(CFG)
  s = parse("ep/2x4x1/cf1.25")
  gpu = predict_step(s, w, PRESETS["h100_cluster"])
  serial = predict_step(s, w, dataclasses.replace(PRESETS["h100_cluster"],
                                                  overlap_param_comm=False))
  assert gpu.hidden_s > 0 and serial.hidden_s == 0
  assert serial.reduce_s - gpu.reduce_s == pytest.approx(gpu.hidden_s)
  assert not PRESETS["cpu"].overlap_param_comm
  assert gpu.hidden_s <= 2 / 3 * (gpu.compute_s + gpu.expert_s) + 1e-12


def test_space_has_stages_microbatches_and_fsdp():
  specs = space(CFG, 8)
  piped = [s for s in specs if s.stage == 2]
  assert piped and {s.microbatches for s in piped} <= {2, 4, 8, 16}
  assert all((16 // s.microbatches) % (s.data * s.expert) == 0 for s in piped)
  assert not [s for s in specs if s.fsdp and s.data == 1]
  assert {s.stage for s in specs} == {1, 2}          # 2 layer groups: P = 4 cannot split them
  assert len(specs) == len(set(specs))


def test_why_invalid_names_pipeline_reasons():
  assert why_invalid(parse("ep/1x4x1/p2/m4/cf1.25"), CFG) is None
  assert why_invalid(parse("ep/1x4x1/p2/m8/cf1.25"), CFG).startswith("train.microbatches=8")
  d_model = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, d_model=132,
                                                               num_heads=2))
  assert "fsdp needs model.d_model=132" in why_invalid(parse("ep/8x1x1/cf1/fsdp"), d_model)
  latent = dataclasses.replace(CFG, model=dataclasses.replace(
      CFG.model, kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=4,
      v_head_dim=4))
  assert "fsdp needs model.kv_lora_rank=12" in why_invalid(parse("ep/8x1x1/cf1/fsdp"), latent)
  circular = parse("ep/1x4x1/p2/v2/m4/cf1")
  if hasattr(CFG.train, "virtual_stages"):        # a build with the circular schedule
    assert circular.apply(CFG).train.virtual_stages == 2
  else:
    assert "circular schedule" in why_invalid(circular, CFG)
  pooled = dataclasses.replace(CFG, strategy=StrategyConfig(pool=("ep/1x4x1/p2/m4/cf1.25",)))
  assert why_invalid(parse("ep/1x4x1/p2/m4/cf1.25"), pooled) is None   # a pool runs under P
  small = dataclasses.replace(CFG, data=DataConfig(global_batch_size=8))
  assert "does not divide" in why_invalid(parse("ep/1x1x1/p2/m16/cf1"), small)


def test_pool_members_share_the_pipeline():
  with pytest.raises(ConfigError, match="share one pipeline"):
    check_pool([parse("ep/2x4x1/cf1.25"), parse("ep/2x4x1/cf1.25/fsdp")], CFG, 8)
  with pytest.raises(ConfigError, match="mesh.stage=1"):
    check_pool([parse("ep/1x4x1/p2/m4/cf1.25")], CFG, 8)
  check_pool([parse("ep/2x4x1/cf1.25"), parse("fsep/1x8x1/c2/cf1.25")], CFG, 8)


def test_plan_pool_shares_one_pipeline_and_prints_how_to_train_it(capsys):
  from moejax import plan as plan_cli
  from moejax.strategy import offline
  rows = offline.rank(CFG, PRESETS["h100_node"], 8)
  assert {r.strategy.stage for r in rows if r.rejected is None} == {1, 2}
  pool = offline.pick_pool(rows, 4, 0.01)
  assert len({offline.pipeline_of(s) for s in pool}) == 1
  piped = [parse("ep/1x4x1/p2/m4/cf1.25/fsdp")]
  assert offline.train_bindings(piped)[:3] == ["mesh.stage = 2", "train.microbatches = 4",
                                               "mesh.fsdp = True"]
  assert not [b for b in offline.train_bindings(piped) if b.startswith("strategy.pool")]
  assert plan_cli.main(["--profile", "h100_node", "--pool", "2", "--all",
                        "--gin_bindings", "moe.capacity = 'slot'"]) == 0
  printed = capsys.readouterr().out
  assert "state MiB" in printed and "/p2/m" in printed
