"""moejax.aot's readers of XLA:GPU's scheduled HLO, on a small hand-written module (no CUDA
plugin needed): collectives per step through a loop's trip count, async and overlapped
bytes, custom calls, the schedule estimate's two streams, and the flags as compiler
options."""

from __future__ import annotations

import pytest

from moejax.aot import estimate as est_lib, read
from moejax.aot.compile import xla_options
from moejax.aot.hlo import parse
from moejax.runtime.xla_flags import GPU_FLAGS

# A loop of 3 iterations whose body starts an all-to-all (1 MiB of bf16), runs a matmul
# fusion, then waits; after the loop a synchronous all-reduce and an all-gather started and
# finished with nothing between; one Triton call.
HLO = """HloModule m, is_scheduled=true

%fused_dot (p0: bf16[512,512], p1: bf16[512,512]) -> bf16[512,512] {
  %p0 = bf16[512,512]{1,0} parameter(0)
  %p1 = bf16[512,512]{1,0} parameter(1)
  ROOT %dot.1 = bf16[512,512]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (arg: (s32[], bf16[512,512], bf16[8,128,512])) -> (s32[], bf16[512,512], bf16[8,128,512]) {
  %arg = (s32[], bf16[512,512]{1,0}, bf16[8,128,512]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[512,512]{1,0} get-tuple-element(%arg), index=1
  %t = bf16[8,128,512]{2,1,0} get-tuple-element(%arg), index=2
  %all-to-all-start = ((bf16[8,128,512]{2,1,0}), bf16[8,128,512]{2,1,0}) all-to-all-start(%t), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(f)/fsep_restore/all_to_all"}
  %fusion = bf16[512,512]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
  %all-to-all-done = bf16[8,128,512]{2,1,0} all-to-all-done(%all-to-all-start)
  ROOT %tuple = (s32[], bf16[512,512]{1,0}, bf16[8,128,512]{2,1,0}) tuple(%i, %fusion, %all-to-all-done)
}

%cond (arg.1: (s32[], bf16[512,512], bf16[8,128,512])) -> pred[] {
  %arg.1 = (s32[], bf16[512,512]{1,0}, bf16[8,128,512]{2,1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x.1: bf16[512,512], t.1: bf16[8,128,512], g: f32[1024]) -> f32[8192] {
  %x.1 = bf16[512,512]{1,0} parameter(0)
  %t.1 = bf16[8,128,512]{2,1,0} parameter(1)
  %g = f32[1024]{0} parameter(2)
  %init = (s32[], bf16[512,512]{1,0}, bf16[8,128,512]{2,1,0}) tuple(%g, %x.1, %t.1)
  %while = (s32[], bf16[512,512]{1,0}, bf16[8,128,512]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %all-reduce = f32[1024]{0} all-reduce(%g), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  %custom-call = f32[1024]{0} custom-call(%all-reduce), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"permute_kernel"}
  %all-gather-start = (f32[1024]{0}, f32[8192]{0}) all-gather-start(%custom-call), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %all-gather-done = f32[8192]{0} all-gather-done(%all-gather-start)
}
"""  # noqa: E501  (HLO lines are as long as XLA writes them)
A2A_BYTES = 8 * 128 * 512 * 2


def test_collectives_per_step_count_loop_iterations():
  found = read.collectives(HLO)
  summary = read.collective_summary(found)
  assert summary == {"all-to-all": {"count": 3, "bytes": 3 * A2A_BYTES},
                     "all-reduce": {"count": 1, "bytes": 4096},
                     "all-gather": {"count": 1, "bytes": 8192 * 4}}
  a2a = next(c for c in found if c.kind == "all-to-all")
  assert a2a.is_async and a2a.compute_between == ["fusion"] and a2a.overlapped
  assert "fsep_restore" in a2a.op_name and not a2a.backward and a2a.group_size == 8
  gather = next(c for c in found if c.kind == "all-gather")
  assert gather.is_async and not gather.overlapped          # nothing between start and done


def test_async_and_overlapped_byte_fractions():
  found = read.collectives(HLO)
  total = 3 * A2A_BYTES + 4096 + 8192 * 4
  assert read.async_bytes_fraction(found) == pytest.approx((3 * A2A_BYTES + 8192 * 4) / total)
  assert read.overlapped_bytes_fraction(found) == pytest.approx(3 * A2A_BYTES / total)


def test_custom_calls_named_by_their_triton_kernel():
  assert read.kernels(HLO) == {"triton:permute_kernel": 1}


def test_estimate_hides_the_async_exchange_behind_the_matmul():
  rates = est_lib.Rates.for_gpu("h100", "1x1x8")
  e = est_lib.estimate(parse(HLO), rates=rates)
  matmul = max(2 * 512**3 / rates.flops_per_s, 3 * 512 * 512 * 2 / rates.hbm_bytes_per_s,
               rates.gpu.kernel_s.value)
  a2a = est_lib.collective_s("all-to-all", A2A_BYTES, "replica_groups={{0,1,2,3,4,5,6,7}}",
                             rates)
  # Per iteration the exchange runs beside the matmul; what it takes longer is exposed.
  assert e.comm_by["restore_forward"] == pytest.approx(3 * a2a)
  assert e.exposed_by["restore_forward"] == pytest.approx(3 * max(a2a - matmul, 0.0))
  assert e.exposed_by["all-reduce"] == pytest.approx(e.comm_by["all-reduce"])   # synchronous
  assert e.exposed_by["all-gather"] == pytest.approx(e.comm_by["all-gather"])   # nothing between
  # The step: kernels, the exposed communication, and the GPU's idle time (per step and
  # per loop iteration).
  idle = rates.gpu.step_idle_s.value + 3 * rates.gpu.iteration_idle_s.value
  assert e.by_category["idle"] == pytest.approx(idle)
  assert e.step_s == pytest.approx(e.compute_s + e.exposed_comm_s + idle)


def test_estimate_splits_compute_by_model_part():
  e = est_lib.estimate(parse(HLO))
  assert sum(e.compute_by.values()) == pytest.approx(e.compute_s)
  name = "jit(train_step)/transpose(jvp(Transformer))/while/body/layers/{}"
  assert est_lib.scope(name.format("attn_moe/vmap(BTNH,BSNH->BNTS)/dot_general")) == (
      "attention core")
  assert est_lib.scope(name.format("attn_0/bqd,dhj->bqhj/dot_general")) == (
      "attention projections")
  assert est_lib.scope(name.format("moe/shard_map/mul")) == "moe"
  assert est_lib.scope(name.format("mlp_0/dot_general")) == "dense mlp"
  assert est_lib.scope("") == "other"


def test_peak_buffers_read_from_an_xla_dump(tmp_path):
  from moejax.aot import peak_buffers as buffers

  stem = tmp_path / "module_0001.jit_train_step.sm_9.0a_gpu_after_optimizations"
  (tmp_path / f"{stem.name}.txt").write_text(
      '  %fusion.1 = f32[8,12,1024,1024]{3,2,1,0} fusion(%a), metadata={op_name="x/attn_0/'
      'vmap(jit(_where))/select_n"}\n'
      '  %while.2 = (s32[], /*index=1*/f32[6,8]{1,0}, bf16[4]{0}) while(%t), '
      'metadata={op_name="x/while"}\n')
  (tmp_path / f"{stem.name}-live-range.txt").write_text(
      "HloLiveRange (max 9):\n  Live ranges at 7 (peak):\n"
      "    fusion.1{}: 402653184 bytes (cumulative: 402653184 bytes)\n"
      "    while.2{2}: 8 bytes (cumulative: 402653192 bytes)\n"
      "    while.2{1}: 192 bytes (cumulative: 402653384 bytes)\n"
      "  Stack trace breakdown for peak usage: 402 653 384 bytes\n    while.2{9}: 1 bytes\n")
  found = buffers.peak_buffers(str(tmp_path))
  assert [(b.name, b.bytes, b.shape) for b in found] == [
      ("fusion.1{}", 402653184, "f32[8,12,1024,1024]{3,2,1,0}"),
      ("while.2{1}", 192, "f32[6,8]{1,0}"), ("while.2{2}", 8, "bf16[4]{0}")]
  assert found[0].op_name.endswith("select_n")
  assert buffers.dump_flags("D")[0] == "--xla_dump_to=D"


def test_collectives_across_hosts_use_the_fabric():
  rates = est_lib.Rates.for_gpu("h100", "8x1x8")
  inside = est_lib.collective_s("all-reduce", 2**26, "replica_groups=[8,8]<=[64]", rates)
  across = est_lib.collective_s("all-reduce", 2**26, "replica_groups=[8,8]<=[8,8]T(1,0)", rates)
  assert across > 2 * inside


def test_gpu_flags_become_typed_compiler_options():
  options = xla_options(GPU_FLAGS)
  assert options["xla_gpu_enable_latency_hiding_scheduler"] is True
  assert options["xla_gpu_experimental_parallel_collective_overlap_limit"] == 8
  assert len(options) == len(GPU_FLAGS)


@pytest.mark.parametrize("gpu,kind", [("h100", "H100"), ("h200", "H200")])
def test_targets_give_compile_only_devices(gpu, kind):
  """Each target's text parses into a topology of 8 compile-only GPUs (the CUDA plugin
  reads it; no GPU needed) with the target's compute capability."""
  from moejax.aot import gpus

  if why := gpus.has_cuda_plugin():
    pytest.skip(why)
  devices = gpus.compile_only_devices(gpu, "1x1x8")
  assert len(devices) == 8 and all(kind in d.device_kind for d in devices), devices
  assert str(devices[0].compute_capability) == "9.0"
  assert len(gpus.compile_only_devices(gpu, "2x1x8")) == 16
