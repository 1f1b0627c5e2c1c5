"""The schedule estimate (moejax.aot.estimate) against measured GPU steps, category by
category, and the FLOP count of every GEMM kernel XLA:GPU emits. No CUDA plugin needed: the
committed scheduled HLO and kernel tables of an H200 run (benchmarks.gpu.on_gpu) are read as
text.

The H200 rates of moejax.strategy.hardware were read off the four kernel tables of the first
H200 run (one rate per kind of kernel, all four steps together), so on them the test checks
that one set of rates holds for every category of every step. Two checks are held out, fitted
to nothing: the second H200 run's eight steps (its shapes' levers among them) and the H100
step, whose rates come from H100 measurements (and the H200's where none exists).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import re

import pytest

from moejax.aot import estimate as est_lib, profile, work
from moejax.aot.hlo import parse
from moejax.strategy.hardware import GPU_RATES, Rate

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "gpu" / "results"
H200_RUN = RESULTS / "on_gpu_h200_first.json"
H200_PROFILES = RESULTS / "on_gpu_h200_first" / "kernel_profiles.json.gz"
H200_HLOS = RESULTS / "on_gpu_h200_first" / "step_hlos.json.gz"
HELD_OUT_RUN = RESULTS / "on_gpu_h200.json"
HELD_OUT_PROFILES = RESULTS / "on_gpu_h200" / "kernel_profiles.json.gz"
HELD_OUT_HLOS = RESULTS / "on_gpu_h200" / "step_hlos.json.gz"
H100_RUN = RESULTS / "on_gpu_h100.json"
H100_HLO = RESULTS / "on_gpu_h100" / "best_step_hlo.txt.gz"
SHAPES = ("mixtral_2l", "qwen3_4l", "gpu_config_ep8_slice", "gpu_config")
# Each shape's step in the run's JSON, whose rows give the model FLOPs per token.
STEP_OF = {"mixtral_2l": "train_mixtral_2l", "qwen3_4l": "train_qwen3_4l",
           "gpu_config_ep8_slice": "train_gpu_config_ep8_slice", "gpu_config": "train_steps"}
CATEGORY_TOLERANCE, STEP_TOLERANCE = 0.15, 0.10

# One of each GEMM kernel XLA:GPU emits, 2 x 64 x 32 x 128 FLOPs each (batch 2 for the
# batched call): cuBLAS's legacy target, cuBLASLt's (jax 0.11), its fp8 form, a Triton GEMM
# fusion, and a Pallas grouped matmul (x [M, K], w [G, K, N]) and its weight gradient (x
# [M, K], dy [M, N] -> [G, K, N]), known by their shapes.
GEMMS = """HloModule m, is_scheduled=true

%triton_gemm (p0: bf16[64,128], p1: bf16[128,32]) -> bf16[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[64,128], b: bf16[128,32], c: bf16[2,64,128], d: bf16[2,128,32], w: bf16[4,128,32], f: f8e4m3fn[64,128], g: f8e4m3fn[128,32], dy: bf16[64,32]) -> bf16[64,32] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,32]{1,0} parameter(1)
  %c = bf16[2,64,128]{2,1,0} parameter(2)
  %d = bf16[2,128,32]{2,1,0} parameter(3)
  %w = bf16[4,128,32]{2,1,0} parameter(4)
  %f = f8e4m3fn[64,128]{1,0} parameter(5)
  %g = f8e4m3fn[128,32]{1,0} parameter(6)
  %legacy = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}
  %lt = (bf16[64,32]{1,0}, s8[33554432]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}
  %batched = (bf16[2,64,32]{2,1,0}, s8[33554432]{0}) custom-call(%c, %d), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":["0"],"lhs_contracting_dimensions":["2"],"rhs_batch_dimensions":["0"],"rhs_contracting_dimensions":["1"]}}}
  %fp8 = (bf16[64,32]{1,0}, s8[33554432]{0}) custom-call(%f, %g), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}
  %gemm_fusion_dot.1 = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%triton_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %pallas = bf16[64,32]{1,0} custom-call(%a, %w), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"gmm"}
  %dy = bf16[64,32]{1,0} parameter(7)
  %tgmm = bf16[4,128,32]{2,1,0} custom-call(%a, %dy), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"tgmm"}
  ROOT %dot = bf16[64,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""  # noqa: E501  (HLO lines are as long as XLA writes them)
GEMM_FLOPS = 2 * 64 * 32 * 128


def _json(path: pathlib.Path):
  with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
    return json.load(f)


def _kernels(module):
  return [(ins, shapes) for ins, shapes, _, _ in profile.kernels_by_instruction(module)]


def test_every_gemm_kernel_counts_its_flops():
  module = parse(GEMMS)
  found = {ins.name: (work.flops(module, ins, shapes), work.category(module, ins, shapes))
           for ins, shapes in _kernels(module)}
  assert found == {"legacy": (GEMM_FLOPS, "gemm"), "lt": (GEMM_FLOPS, "gemm"),
                   "batched": (2 * GEMM_FLOPS, "gemm"), "fp8": (GEMM_FLOPS, "gemm"),
                   "gemm_fusion_dot.1": (GEMM_FLOPS, "gemm"), "pallas": (GEMM_FLOPS, "gemm"),
                   "tgmm": (GEMM_FLOPS, "gemm"), "dot": (GEMM_FLOPS, "gemm")}
  pallas = {"pallas", "tgmm"}
  assert {ins.name: work.gemm_dims(module, ins, shapes) for ins, shapes in _kernels(module)
          if ins.name not in pallas} == dict.fromkeys(set(found) - pallas, (64, 32, 128))
  # moejax's grouped matmul at its own rate, below a dense GEMM's (bytes and the shortest
  # kernel made free, so that the FLOPs set the time).
  rates = est_lib.Rates.for_gpu("h100", "1x1x1")
  free = dataclasses.replace(rates.gpu, kernel_s=Rate(0.0, "test"),
                             hbm_bytes_per_s=Rate(1e30, "test"))
  rates = dataclasses.replace(rates, gpu=free)
  entry = module.by_name(module.entry)
  for name, rate in (("pallas", free.grouped_flops_per_s), ("lt", free.gemm_flops_per_s)):
    assert est_lib.kernel(module, entry[name], entry, rates).seconds == pytest.approx(
        GEMM_FLOPS / rate.value), name
  lt = next(ins for ins, _ in _kernels(module) if ins.name == "lt")
  # A library call's workspace (its s8 result) is scratch, not traffic.
  assert work.kernel_bytes(module, lt, module.by_name(module.entry)) == (64 * 128 + 128 * 32 +
                                                                         64 * 32) * 2


SOFTMAX = """HloModule m

%softmax_sum (p: f32[2,8,8]) -> f32[2,8] {
  %p = f32[2,8,8]{2,1,0} parameter(0)
  %e = f32[2,8,8]{2,1,0} exponential(%p), metadata={op_name="jit(train_step)/Transformer.groups/while/body/layers/attn_moe/vmap()/exp"}
  %z = f32[] constant(0), metadata={op_name="jit(train_step)/Transformer.groups/while/body/layers/ln_moe/mul"}
  ROOT %r = f32[2,8]{1,0} reduce(%e, %z), dimensions={2}, to_apply=%add
}

ENTRY %main (s: f32[2,8,8]) -> f32[2,8] {
  %s = f32[2,8,8]{2,1,0} parameter(0)
  ROOT %fusion.1 = f32[2,8]{1,0} fusion(%s), kind=kLoop, calls=%softmax_sum
}
"""  # noqa: E501  (HLO lines are as long as XLA writes them)


def test_an_unnamed_fusion_counts_under_the_name_inside_it():
  """XLA leaves some fusions without an op name (the softmax sums of an unfused attention
  core): such a kernel counts under the name nearest its root (the exponent it sums, not the
  constant written after it), so the compile-only program's softmax is inside the fused
  attention kernel a GPU runs (no time of its own), not elementwise work (Mixtral-8x7B on 64
  GPUs: 0.11 s a step was)."""
  module = parse(SOFTMAX)
  entry = module.by_name(module.entry)
  fusion = entry["fusion.1"]
  assert fusion.op_name == ""
  assert work.source_name(module, fusion).endswith("attn_moe/vmap()/exp")
  assert work.category(module, fusion, entry) == "attention"
  rates = est_lib.Rates.for_gpu("h100", "1x1x1")
  assert est_lib.kernel(module, fusion, entry, rates).seconds == 0.0


@pytest.mark.parametrize("shape", SHAPES)
def test_committed_programs_count_their_gemm_flops(shape):
  """Every cuBLAS(Lt) call of the measured programs has FLOPs, and the FLOPs the GEMMs and
  attention execute are between 4/3 and 2 times the model's: remat runs every forward a
  second time (8 of the 6 FLOPs per parameter and token at least); capacity padding and the
  tiled loss's recompute add less than the rest."""
  module = parse(_json(H200_HLOS)[shape])
  executed = 0.0
  for ins, shapes, runs, _ in profile.kernels_by_instruction(module):
    if work.is_library_gemm(ins):
      assert work.flops(module, ins, shapes) > 0, ins.line[:200]
    if (attn := work.attention(ins, shapes)) is not None:
      executed += attn.flops * runs
    elif work.category(module, ins, shapes) == "gemm":
      executed += work.flops(module, ins, shapes) * runs
  step = _json(H200_RUN)["steps"][STEP_OF[shape]]
  best = next(r for r in step["rows"] if r["path"] == step["best"])
  model = best["flops_per_token"] * step["tokens_per_step"]
  assert 4 / 3 <= executed / model <= 2, executed / model


@pytest.fixture(scope="module")
def h200_comparisons():
  steps = {r["shape"]: r["measured_step_s"]
           for r in _json(H200_RUN)["steps"]["schedule_estimate"]["rows"]}
  return profile.comparisons(_json(H200_PROFILES), _json(H200_HLOS), steps, "h200")


@pytest.mark.parametrize("shape", SHAPES)
def test_estimate_holds_category_by_category(shape, h200_comparisons):
  """Each category of the estimate within 15% of the measured kernel table (one GPU: no
  collectives in either), the step within 10%."""
  rows = h200_comparisons[shape]
  assert rows["collectives"]["measured_s"] == rows["collectives"]["estimate_s"] == 0.0
  off = {c: f"{r['error']:+.1%}" for c, r in rows.items() if r["error"] is not None and
         abs(r["error"]) > (STEP_TOLERANCE if c == "step" else CATEGORY_TOLERANCE)}
  assert not off, f"{shape}: categories off: {off}"


def _held_out_steps():
  return [row["shape"] for row in _json(HELD_OUT_RUN)["steps"]["schedule_estimate"]["rows"]
          if row["shape"] in _json(HELD_OUT_PROFILES)]


# Without remat, the Mixtral cut's copies (224 GB a step: the stacked activations) ran at
# 1.96 TB/s where the first run's fitted 3.48, so its elementwise category is 15.6% low.
MISSED = {"mixtral_2l, microbatches 2, no remat":
          "no-remat copies at 1.96 TB/s, not the fitted 3.48: elementwise -15.6%"}


@pytest.fixture(scope="module")
def held_out_comparisons():
  steps = {r["shape"]: r["measured_step_s"]
           for r in _json(HELD_OUT_RUN)["steps"]["schedule_estimate"]["rows"]}
  return profile.comparisons(_json(HELD_OUT_PROFILES), _json(HELD_OUT_HLOS), steps, "h200")


@pytest.mark.parametrize("shape", [
    pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=MISSED[s])) if s in MISSED else s
    for s in _held_out_steps()])
def test_estimate_holds_on_the_held_out_run(shape, held_out_comparisons):
  """The second H200 run's steps, none of which a rate was fitted to: each kernel category
  within 15% of its kernel table, the step within 10%. Idle is the step less the GPU's busy
  time, so the step's check holds it; on its own it is a residual of a few ms that every
  timing's noise lands in (off by 1-10 ms here: decision 0126)."""
  rows = held_out_comparisons[shape]
  off = {c: f"{r['error']:+.1%}" for c, r in rows.items() if r["error"] is not None and
         c != "idle" and
         abs(r["error"]) > (STEP_TOLERANCE if c == "step" else CATEGORY_TOLERANCE)}
  assert not off, f"{shape}: categories off: {off}"


def test_every_measured_kernel_has_a_category():
  hlos = _json(H200_HLOS)
  steps = {r["shape"]: r["measured_step_s"]
           for r in _json(H200_RUN)["steps"]["schedule_estimate"]["rows"]}
  for shape, prof in _json(H200_PROFILES).items():
    m = profile.measured(prof, parse(hlos[shape]), steps[shape])
    assert m.unmatched_s == 0.0, shape
    assert sum(m.by_category.values()) == pytest.approx(
        prof["kernel_us_per_step"] * 1e-6 + m.by_category["idle"], rel=1e-5)   # rows: 0.01 us


def test_profile_command_prints_each_category_and_the_rates(capsys):
  assert profile.main([str(H200_PROFILES), str(H200_HLOS), str(H200_RUN), "--rates"]) == 0
  out = capsys.readouterr().out
  assert all(f"{shape}: ms estimated / measured" in out for shape in SHAPES), out
  for c in (*work.CATEGORIES, "step"):       # one line per step, in each step's block
    assert len(re.findall(rf"^  {c} +[\d.]+ +[\d.]+", out, re.M)) == len(SHAPES), c
  assert "attention fwd 128 4096" in out and "gemm" in out.split("rates,")[1]


def test_h100_step_held_out():
  """The H100 run's measured step (none of the H100 rates was fitted to it) within 10%."""
  run = _json(H100_RUN)["steps"]["schedule_estimate"]
  with gzip.open(H100_HLO, "rt") as f:
    e = est_lib.estimate(parse(f.read()), "h100", "1x1x1")
  assert e.step_s / run["measured_step_s"] - 1 == pytest.approx(0.0, abs=STEP_TOLERANCE)


# XLA's unfused attention core (a compile-only program's: no cuDNN there): the scores'
# matmul of one head of 1024 positions and head dim 64, forward and backward.
UNFUSED = """HloModule m, is_scheduled=true

ENTRY %main (q: bf16[8,12,1024,64], k: bf16[8,12,1024,64], s: f32[8,12,1024,1024]) -> f32[8,12,1024,1024] {
  %q = bf16[8,12,1024,64]{3,2,1,0} parameter(0)
  %k = bf16[8,12,1024,64]{3,2,1,0} parameter(1)
  %s = f32[8,12,1024,1024]{3,2,1,0} parameter(2)
  %fwd = f32[8,12,1024,1024]{3,2,1,0} dot(%q, %k), lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}, rhs_contracting_dims={3}, metadata={op_name="jit(train_step)/jvp(Transformer)/layers/attn_0/vmap(BTNH,BSNH->BNTS)/dot_general"}
  %softmax = f32[8,12,1024,1024]{3,2,1,0} exponential(%fwd), metadata={op_name="jit(train_step)/jvp(Transformer)/layers/attn_0/vmap(jit(_softmax))/exp"}
  ROOT %bwd = f32[8,12,1024,1024]{3,2,1,0} dot(%q, %k), lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}, rhs_contracting_dims={3}, metadata={op_name="jit(train_step)/transpose(jvp(Transformer))/layers/attn_0/vmap(BTNH,BSNH->BNTS)/dot_general"}
}
"""  # noqa: E501


def test_unfused_attention_costs_as_the_fused_kernel():
  """A compile-only program's attention core is costed as cuDNN's fused kernel: its
  matmuls' causal half at the measured rate for head dim 64 and 1024 positions (the backward
  at 2.5 / 2 the unfused matmuls' FLOPs: it recomputes the scores), its softmax inside."""
  rate = GPU_RATES["h200"].attention_rate(64, 1024)
  flops = 2.0 * 8 * 12 * 1024 * 1024 * 64
  e = est_lib.estimate(parse(UNFUSED), "h200", "1x1x1")
  want = 0.5 * flops / rate.fwd_flops_per_s + 0.5 * 1.25 * flops / rate.bwd_flops_per_s
  assert e.by_category["attention"] == pytest.approx(want)
  assert e.kernels == 2                  # the softmax is inside the fused kernel


# A loop of 4 tiles whose body runs a dot in the true branch of a two-way conditional (as
# `lax.cond` inside a `lax.scan` compiles: true_computation / false_computation, not
# branch_computations), and nothing in the false one.
CONDITIONAL = """HloModule cond

%run (p: (bf16[64,128], bf16[128,32])) -> bf16[64,32] {
  %p = (bf16[64,128]{1,0}, bf16[128,32]{1,0}) parameter(0)
  %a = bf16[64,128]{1,0} get-tuple-element(%p), index=0
  %b = bf16[128,32]{1,0} get-tuple-element(%p), index=1
  ROOT %dot = bf16[64,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%skip (q: bf16[64,32]) -> bf16[64,32] {
  ROOT %q = bf16[64,32]{1,0} parameter(0)
}

%body (s: (s32[], bf16[64,128], bf16[128,32], bf16[64,32], pred[])) -> (s32[], bf16[64,128], bf16[128,32], bf16[64,32], pred[]) {
  %s = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, bf16[64,32]{1,0}, pred[]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %a = bf16[64,128]{1,0} get-tuple-element(%s), index=1
  %b = bf16[128,32]{1,0} get-tuple-element(%s), index=2
  %y = bf16[64,32]{1,0} get-tuple-element(%s), index=3
  %use = pred[] get-tuple-element(%s), index=4
  %ab = (bf16[64,128]{1,0}, bf16[128,32]{1,0}) tuple(%a, %b)
  %c = bf16[64,32]{1,0} conditional(%use, %ab, %y), true_computation=%run, false_computation=%skip
  ROOT %t = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, bf16[64,32]{1,0}, pred[]) tuple(%i, %a, %b, %c, %use)
}

%cond (s: (s32[], bf16[64,128], bf16[128,32], bf16[64,32], pred[])) -> pred[] {
  %s = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, bf16[64,32]{1,0}, pred[]) parameter(0)
  ROOT %p = pred[] get-tuple-element(%s), index=4
}

ENTRY %main (init: (s32[], bf16[64,128], bf16[128,32], bf16[64,32], pred[])) -> (s32[], bf16[64,128], bf16[128,32], bf16[64,32], pred[]) {
  %init = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, bf16[64,32]{1,0}, pred[]) parameter(0)
  ROOT %w = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, bf16[64,32]{1,0}, pred[]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""  # noqa: E501


def test_a_conditional_costs_its_dearer_branch():
  """The kernels of a two-way conditional's branches (true_computation / false_computation,
  as a `lax.cond` in a scan compiles) are costed: the dearer branch, every loop iteration."""
  module = parse(CONDITIONAL)
  assert module.runs()["run"] == 4
  rates = est_lib.Rates.for_gpu("h100", "1x1x1")
  dot = est_lib.kernel(module, module.by_name("run")["dot"], module.by_name("run"), rates)
  assert dot.category == "gemm" and dot.seconds > 0
  e = est_lib.estimate(module, "h100", "1x1x1")
  assert e.by_category["gemm"] == pytest.approx(4 * dot.seconds)
  assert e.kernels == 4


def test_sustained_rates_stay_under_the_datasheet():
  for gpu in GPU_RATES.values():
    assert gpu.grouped_flops_per_s.value < gpu.gemm_flops_per_s.value < gpu.peak_flops.value
    memory = ("hbm", "copy", "fill", "reduce", "scatter", "gather")
    assert all(0 < getattr(gpu, f"{k}_bytes_per_s").value < gpu.peak_hbm_bytes_per_s.value
               for k in memory), gpu.name
    assert all(a.fwd_flops_per_s < gpu.peak_flops.value > a.bwd_flops_per_s
               for a in gpu.attention), gpu.name


def test_every_rate_names_its_source():
  """Each rate of the table says where it comes from; a committed measurement it names
  exists."""
  for gpu in GPU_RATES.values():
    sources = [r.source for r in gpu.rates().values()] + [a.source for a in gpu.attention]
    assert all(len(s) > 10 for s in sources), gpu.name
    named = r"benchmarks/(?:\w+/)?results/[\w./]+\w"
    for path in {p for s in sources for p in re.findall(named, s)}:
      assert (ROOT / path).exists(), f"{gpu.name} names {path}, which does not exist"
