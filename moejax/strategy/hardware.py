"""What each GPU sustains: one table, each rate with its source, read by every estimate (the
cost model's GPU presets, moejax.strategy.cost, and through them the placement planners' cost
model; the schedule estimate of a compiled program, moejax.aot.estimate).

A source is a datasheet, or a committed measurement and how the number was read from it. A
rate no measurement backs yet says so ("assumed"). The H200 rates are read from the kernel
table of its first one-GPU train steps
(benchmarks/gpu/results/on_gpu_h200_first/kernel_profiles.json.gz: every kernel's time per
step, profiled) against the FLOPs and bytes of the same programs' scheduled HLO
(step_hlos.json.gz): kernel times, not the per-call rates of on_gpu_h200_first.json's `rates`
step, whose small GEMMs and copies were timed per Python dispatch and are launch-bound. The
second H200 run (on_gpu_h200.json and its folder) was fitted to nothing: its eight steps
check these rates held out.
"""

from __future__ import annotations

import dataclasses
import math

H200_PROFILE = ("benchmarks/gpu/results/on_gpu_h200_first/kernel_profiles.json.gz with "
                "step_hlos.json.gz (4 one-GPU train steps, jax 0.11.2)")


@dataclasses.dataclass(frozen=True)
class Rate:
  value: float
  source: str


@dataclasses.dataclass(frozen=True)
class Link:
  """Collectives over one kind of link: bytes a device sends per second in an all-to-all,
  the bus bandwidth of a reduction, and a fixed cost per call."""
  a2a_bytes_per_s: Rate
  reduce_bytes_per_s: Rate
  latency_s: Rate


@dataclasses.dataclass(frozen=True)
class AttentionRate:
  """cuDNN's fused flash attention (bf16, causal) at one head dim and sequence length: FLOP/s
  of the forward on its causal FLOPs (4 B H S^2 D / 2) and of the backward on 2.5 times
  those."""
  head_dim: int
  seq_len: int
  fwd_flops_per_s: float
  bwd_flops_per_s: float
  source: str


@dataclasses.dataclass(frozen=True)
class GpuRates:
  name: str
  # The datasheet's ceilings (MFU's denominator; every sustained rate below them):
  peak_flops: Rate                # dense bf16 tensor-core peak
  peak_hbm_bytes_per_s: Rate
  gemm_flops_per_s: Rate          # cuBLAS(Lt) and XLA's GEMMs, as a train step runs them
  grouped_flops_per_s: Rate       # moejax's grouped matmul (ragged dispatch's Pallas kernel)
  # Bytes a kernel moves per second, by how it moves them (moejax.aot.work.memory_kind):
  hbm_bytes_per_s: Rate           # streaming elementwise kernels (reads and writes)
  copy_bytes_per_s: Rate          # copies and async slices (memcpy)
  fill_bytes_per_s: Rate          # write-only fills
  reduce_bytes_per_s: Rate        # reductions
  scatter_bytes_per_s: Rate       # scatter-adds (atomics)
  gather_bytes_per_s: Rate        # gathers by index
  sort_s: Rate                    # one sort (XLA's or CUB's) of 16K-64K keys
  kernel_s: Rate                  # the shortest a kernel takes
  # The GPU's idle time: a fixed part per step (the host dispatches it) and a part per loop
  # iteration (the host launches each iteration's command buffer).
  step_idle_s: Rate
  iteration_idle_s: Rate
  attention: tuple[AttentionRate, ...]
  node: Link                      # collectives within a host (NVLink)
  cluster: Link                   # collectives across hosts (one 400 Gb/s NIC per GPU)

  def attention_rate(self, head_dim: int, seq_len: int) -> AttentionRate:
    """The measured point nearest in head dim, then in sequence length (log scale)."""
    return min(self.attention, key=lambda a: (abs(a.head_dim - head_dim),
                                             abs(math.log(a.seq_len / max(seq_len, 1)))))

  def memory_rate(self, kind: str) -> Rate:
    """The bytes/s of a memory-bound kernel of `kind` (not 'sort', which is per call)."""
    return getattr(self, "hbm_bytes_per_s" if kind == "stream" else f"{kind}_bytes_per_s")

  def rates(self) -> dict[str, Rate]:
    """Every scalar rate by field name (the links' as node.*, cluster.*)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if isinstance(getattr(self, f.name), Rate)}
    for link in ("node", "cluster"):
      for f in dataclasses.fields(Link):
        out[f"{link}.{f.name}"] = getattr(getattr(self, link), f.name)
    return out


_DATASHEET = "NVIDIA {} SXM datasheet"
_ASSUMED = "assumed (no collective measured yet)"
# NVLink 4: 900 GB/s both directions per GPU; one ConnectX-7 400 Gb/s NIC per GPU in
# DGX/HGX nodes. The same parts on H100 and H200 nodes.
_NODE = Link(Rate(200e9, f"{_ASSUMED}: about half of NVLink 4's 450 GB/s per direction "
                         "(datasheet) for the all-to-all"),
             Rate(250e9, "assumed: NCCL's all-reduce bus bandwidth on NVLink 4, ~0.55 of 450"),
             Rate(20e-6, "assumed: NCCL's per-call latency within a node"))
_CLUSTER = Link(Rate(40e9, f"{_ASSUMED}: 0.8 of the 50 GB/s NIC (ConnectX-7 datasheet) for "
                           "the all-to-all"),
                Rate(80e9, "assumed: hierarchical all-reduce (NVLink in the node, the NIC "
                           "across), bus bandwidth"),
                Rate(30e-6, "assumed: NCCL's per-call latency across nodes"))
_H100_RUN = "benchmarks/gpu/results/on_gpu_h100.json (train_steps.profile, one H100, jax 0.11.2)"

_FIT = (f"{H200_PROFILE}; `python -m moejax.aot.profile --rates`: the HLO's work of this kind "
        "per step over its kernels' measured time, the four steps together")


def _like_h200(kind: str, h200: float) -> str:
  return (f"assumed: the H200's {kind} rate in proportion to its streaming rate "
          f"({h200:.2f} of it; not measured on an H100)")


GPU_RATES = {
    "h100": GpuRates(
        name="h100",
        peak_flops=Rate(989e12, _DATASHEET.format("H100")),
        peak_hbm_bytes_per_s=Rate(3.35e12, _DATASHEET.format("H100")),
        gemm_flops_per_s=Rate(0.65 * 989e12, "benchmarks/kernels/results/gmm_tiles_h100.json: "
                              "XLA's dense dot at 131072 x 1024 x 2048, 635-653 TFLOP/s "
                              "(0.65 of the peak)"),
        grouped_flops_per_s=Rate(0.40 * 989e12, "benchmarks/kernels/results/gmm_tiles_h100.json: "
                                 "moejax's grouped kernel with its Hopper tiles, 353-438 TFLOP/s "
                                 "(0.40 of the peak)"),
        hbm_bytes_per_s=Rate(3.0e12, f"{_H100_RUN}: the AdamW update of the 32 experts "
                             "(loop_select_fusion_2, 2 x 6.34 GB in 4.21 ms)"),
        copy_bytes_per_s=Rate(2.5e12, _like_h200("copy", 0.83)),
        fill_bytes_per_s=Rate(2.2e12, _like_h200("fill", 0.72)),
        reduce_bytes_per_s=Rate(2.5e12, _like_h200("reduction", 0.82)),
        scatter_bytes_per_s=Rate(0.75e12, f"{_H100_RUN}: the MoE backward's scatter-adds "
                                 "(input_scatter_fusion)"),
        gather_bytes_per_s=Rate(1.2e12, _like_h200("gather", 0.39)),
        sort_s=Rate(34e-6, "assumed: the H200's (a sort of 16K-64K keys is latency-bound)"),
        kernel_s=Rate(1.5e-6, "assumed: the H200's"),
        step_idle_s=Rate(1.3e-3, "assumed: the H200's (host work: the same jax and driver)"),
        iteration_idle_s=Rate(55e-6, "assumed: the H200's (host work: the same jax and driver)"),
        attention=(AttentionRate(64, 1024, 283e12, 220e12,
                                 f"{_H100_RUN}: cuDNN's fprop 1.09 ms for 24 calls; the "
                                 "backward assumed at the H200's (its helper kernels are not "
                                 "in the table's top 25)"),),
        node=_NODE, cluster=_CLUSTER),
    "h200": GpuRates(
        name="h200",
        peak_flops=Rate(989e12, _DATASHEET.format("H200")),
        peak_hbm_bytes_per_s=Rate(4.8e12, _DATASHEET.format("H200")),
        gemm_flops_per_s=Rate(758e12, f"{_FIT} (cuBLASLt and Triton GEMMs; 710-771 per step)"),
        grouped_flops_per_s=Rate(0.40 * 989e12, "assumed: the H100's fraction of the peak (not "
                                 "measured on an H200)"),
        hbm_bytes_per_s=Rate(4.19e12, f"{_FIT} (3.5-4.3 TB/s per step)"),
        copy_bytes_per_s=Rate(3.48e12, f"{_FIT} (memcpy of copies and async slices; "
                                       "on_gpu_h200_first.json rates.hbm's 2 GiB copy: 3.23 TB/s)"),
        fill_bytes_per_s=Rate(3.03e12, f"{_FIT} (2.7-3.5 TB/s per step)"),
        reduce_bytes_per_s=Rate(3.44e12, f"{_FIT} (3.3-3.7 TB/s per step)"),
        scatter_bytes_per_s=Rate(0.76e12, f"{_FIT} (0.69-0.78 TB/s per step)"),
        gather_bytes_per_s=Rate(1.64e12, f"{_FIT} (0.8-1.9 TB/s per step)"),
        sort_s=Rate(34e-6, f"{_FIT} (XLA's sort of 16K keys, CUB's of 64K)"),
        kernel_s=Rate(1.5e-6, f"{H200_PROFILE}: scalar kernels (a loop counter's add) take "
                              "1-1.6 us"),
        step_idle_s=Rate(1.3e-3, f"{H200_PROFILE}: the measured step less the GPU's busy time, "
                                 "fitted as a part per step and a part per loop iteration"),
        iteration_idle_s=Rate(55e-6, f"{H200_PROFILE}: the measured step less the GPU's busy "
                                     "time, fitted as a part per step and a part per loop "
                                     "iteration"),
        attention=(AttentionRate(64, 1024, 280e12, 220e12, _FIT),
                   AttentionRate(128, 4096, 550e12, 443e12, _FIT),
                   AttentionRate(128, 8192, 419e12, 505e12,
                                 "benchmarks/gpu/results/on_gpu_h200_first.json "
                                 "rates.attention (cudnn, "
                                 "batch 1, 32 heads, 8 kv heads): fwd 1.31 ms, fwd+bwd 4.04 ms, "
                                 "timed per call (at 4096 such timing reads 0.63x the kernel "
                                 "table's forward rate: a lower bound)")),
        node=_NODE, cluster=_CLUSTER),
}
