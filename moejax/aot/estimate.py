"""A step-time estimate walked from XLA:GPU's schedule (jax exposes no estimate of XLA's
own: `cost_analysis()` is None for these programs and the latency-hiding scheduler's
estimates stay inside XLA).

The walk follows the scheduled HLO in order on two streams per computation. Kernels run one
after another on the compute stream, each by what it computes and moves (moejax.aot.work):
GEMM FLOPs at the GPU's sustained GEMM rate (moejax's grouped matmul at its own), bytes at
the rate of how the kernel moves them (streaming, copies, fills, reductions, scatters,
gathers; a sort per call), never shorter than the shortest kernel; cuDNN's fused attention at
its measured rate by head dim and sequence length, and XLA's unfused attention core (what a
compile-only program holds: cuDNN cannot be built there) costed as that fused kernel, which a
GPU run gets. The GPU idles a fixed time per step and per loop iteration (the host launches
each iteration's command buffer). Collectives go by alpha-beta (per-call latency plus bytes
over the link's bandwidth: NVLink inside a host, the network across hosts), an async one on a
communication stream from its start, the compute stream waiting at its done only for what is
left (exposed). A loop body counts its trip count times. Every rate comes from
moejax.strategy.hardware's table, with its source.

Limits: Pallas/Mosaic kernels' FLOPs are known only for the grouped matmul's shapes
([M, K] x [G, K, N], and its weight gradient), others count bytes only; one GEMM rate for
every shape; one communication stream (XLA may run several); a compile-only program is not
autotuned, so XLA's GEMM and fusion choices may differ from a GPU's compile.
"""

from __future__ import annotations

import dataclasses

from moejax.aot import work
from moejax.aot.gpus import host_size
from moejax.aot.hlo import Instr, Module, parse
from moejax.aot.read import KINDS, collective_kind, first_group
from moejax.config import ConfigError
from moejax.strategy.hardware import GPU_RATES, GpuRates, Link

# Bytes moved per byte of a collective's buffer, over a group of n (ring algorithms).
_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
           "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
           "ragged-all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0,
           "collective-broadcast": lambda n: 1.0}
# cuDNN's backward FLOPs are 2.5 x the forward's (it recomputes the scores); XLA's unfused
# backward runs 4 matmuls to the forward's 2, so its FLOPs become the fused kernel's x 1.25.
_FUSED_BWD_PER_UNFUSED = 2.5 / 2


@dataclasses.dataclass(frozen=True)
class Rates:
  gpu: GpuRates
  per_host: int             # GPUs per host: collectives within one run on NVLink

  @classmethod
  def for_gpu(cls, name: str, topology: str) -> Rates:
    """The table's rates of GPU `name` (moejax.strategy.hardware.GPU_RATES)."""
    if name not in GPU_RATES:
      raise ConfigError(f"gpu={name!r} has no rates; use one of {sorted(GPU_RATES)} (or add "
                        "its row to moejax.strategy.hardware.GPU_RATES, with sources).")
    return cls(GPU_RATES[name], host_size(topology))

  @property
  def flops_per_s(self) -> float:
    return self.gpu.gemm_flops_per_s.value

  @property
  def hbm_bytes_per_s(self) -> float:
    return self.gpu.hbm_bytes_per_s.value


@dataclasses.dataclass
class Estimate:
  step_s: float
  exposed_comm_s: float     # time the compute stream waited for collectives
  compute_s: float          # kernels on the compute stream
  comm_s: float             # collective time, hidden or not
  # per collective label (`label`): its time, and the part the compute stream waited for
  comm_by: dict[str, float] = dataclasses.field(default_factory=dict)
  exposed_by: dict[str, float] = dataclasses.field(default_factory=dict)
  compute_by: dict[str, float] = dataclasses.field(default_factory=dict)   # per `scope`
  # per moejax.aot.work.CATEGORIES: kernel time by category, collectives' whole time, and
  # the idle gaps between kernels
  by_category: dict[str, float] = dataclasses.field(default_factory=dict)
  kernels: float = 0.0      # kernels per step


def scope(op: str) -> str:
  """Which part of the model a kernel computes, by the JAX op name of what it computes
  (`work.source_name`): 'attention core' (scores, softmax and weighted values:
  jax.nn.dot_product_attention's vmapped ops, or the fused kernel), 'attention projections',
  'moe' (the MoE layer, fsep's restores included), 'dense mlp', else 'other' (embedding,
  loss, optimizer, glue)."""
  if work.in_attention_core_name(op):
    return "attention core"
  if "/attn" in op:
    return "attention projections"
  if "/moe" in op or "MoELayer" in op or "fsep" in op:
    return "moe"
  if "/mlp" in op or "/shared" in op:
    return "dense mlp"
  return "other"


def label(kind: str, line: str) -> str:
  """A collective's label: fsep's weight restores for the forward (`restore_forward`) and for
  the backward pass (`restore_backward`, under moejax.model.transformer's BACKWARD_RESTORE
  scope), their transposes that return the weights' gradients (`restore_gradient`); else
  its kind."""
  if "fsep_restore" in line:
    if "backward_restore/" in line:
      return "restore_backward"
    return "restore_gradient" if "transpose(" in line else "restore_forward"
  return kind


def collective_s(kind: str, size: int, line: str, rates: Rates) -> float:
  group = first_group(line) or [0]
  n = max(len(group), 2 if kind.startswith("collective") else 1)
  if n == 1:
    return 0.0
  crosses = len({d // rates.per_host for d in group}) > 1
  link: Link = rates.gpu.cluster if crosses else rates.gpu.node
  bw = link.a2a_bytes_per_s if "all-to-all" in kind or kind.startswith("collective") else (
      link.reduce_bytes_per_s)
  return link.latency_s.value + _FACTOR[kind](n) * size / bw.value


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel's cost: seconds on the compute stream, the category they count under and the
  op name of what the kernel computes (`work.source_name`, which `scope` reads)."""
  seconds: float
  category: str
  source: str = ""


def kernel(module: Module, ins: Instr, shapes: dict[str, Instr], rates: Rates,
           result: Instr | None = None) -> Kernel:
  """The cost of one kernel instruction (`result`: a fusion-start's done, whose shape is
  the kernel's output)."""
  g = rates.gpu
  source = work.source_name(module, ins)
  category = work.category(module, ins, shapes, source)
  shortest = g.kernel_s.value
  if (attn := work.attention(ins, shapes)) is not None:
    r = g.attention_rate(attn.head_dim, attn.kv_len)
    return Kernel(max(attn.flops / (r.bwd_flops_per_s if attn.backward else r.fwd_flops_per_s),
                      shortest), category, source)
  flops = work.flops(module, ins, shapes)
  if category == "attention":
    # XLA's unfused attention core: what cuDNN's fused kernel would compute instead. Its
    # matmuls become the fused kernel's FLOPs (causal: half of them) at the measured rate
    # for their head dim (the smallest of M, N, K) and sequence (the largest); its softmax
    # and masking run inside that kernel.
    if flops == 0:
      return Kernel(0.0, category, source)
    dims = work.gemm_dims(module, ins, shapes)
    r = g.attention_rate(min(dims), max(dims)) if dims else g.attention_rate(128, 4096)
    backward = "transpose(" in source
    fused = 0.5 * flops * (_FUSED_BWD_PER_UNFUSED if backward else 1.0)
    return Kernel(fused / (r.bwd_flops_per_s if backward else r.fwd_flops_per_s), category,
                  source)
  moved = work.kernel_bytes(module, ins, shapes, result)
  kind = work.memory_kind(module, ins)
  if kind == "sort":
    return Kernel(g.sort_s.value, category, source)
  # moejax's grouped matmul (a Pallas/Mosaic call) runs below a dense GEMM of its size.
  rate = g.grouped_flops_per_s if work.grouped_matmul_flops(ins, shapes) else g.gemm_flops_per_s
  return Kernel(max(flops / rate.value, moved / g.memory_rate(kind).value, shortest), category,
                source)


class _Walk:
  def __init__(self, module: Module, rates: Rates):
    self.module, self.rates = module, rates
    self._memo: dict[str, Estimate] = {}

  @staticmethod
  def _add(table: dict[str, float], key: str, value: float, times: float = 1) -> None:
    table[key] = table.get(key, 0.0) + value * times

  def _merge(self, into: Estimate, child: Estimate, times: float) -> None:
    into.step_s += times * child.step_s
    into.exposed_comm_s += times * child.exposed_comm_s
    into.compute_s += times * child.compute_s
    into.comm_s += times * child.comm_s
    into.kernels += times * child.kernels
    for mine, theirs in ((into.comm_by, child.comm_by), (into.exposed_by, child.exposed_by),
                         (into.compute_by, child.compute_by),
                         (into.by_category, child.by_category)):
      for key, value in theirs.items():
        self._add(mine, key, value, times)

  def run(self, comp: str) -> Estimate:
    """One run of `comp`: its time (`step_s`) and the tables."""
    if comp in self._memo:
      return self._memo[comp]
    module, rates = self.module, self.rates
    instrs = module.computations[comp]
    shapes = module.by_name(comp)
    e = Estimate(0.0, 0.0, 0.0, 0.0, by_category={c: 0.0 for c in work.CATEGORIES})
    comm_free, pending = 0.0, {}
    for ins in instrs:
      kind = collective_kind(ins, module)
      if kind in KINDS:
        size = ins.bytes()
        if ins.opcode.endswith("-start"):
          done = next((d for d in instrs if ins.name in d.operands and
                       d.opcode.endswith("-done")), None)
          size = max(done.bytes(), size - done.bytes()) if done is not None else size
        cost = collective_s(kind, size, ins.line, rates)
        e.comm_s += cost
        tag = label(kind, ins.line)
        self._add(e.comm_by, tag, cost)
        self._add(e.by_category, "collectives", cost)
        if ins.opcode.endswith("-start"):
          begin = max(e.step_s, comm_free)
          comm_free = begin + cost
          pending[ins.name] = (comm_free, tag)
        else:                                   # synchronous: on the compute stream
          start = max(e.step_s, comm_free)
          e.exposed_comm_s += start + cost - e.step_s
          self._add(e.exposed_by, tag, start + cost - e.step_s)
          e.step_s = comm_free = start + cost
      elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in pending:
        finish, tag = pending.pop(ins.operands[0])
        if finish > e.step_s:
          e.exposed_comm_s += finish - e.step_s
          self._add(e.exposed_by, tag, finish - e.step_s)
          e.step_s = finish
      elif ins.opcode == "while":
        n = ins.trip_count()
        n = 1 if n is None else n
        self._merge(e, self.run(ins.attr("body")), n)
        idle = n * rates.gpu.iteration_idle_s.value     # the host launches each iteration
        e.step_s += idle
        self._add(e.by_category, "idle", idle)
      elif ins.opcode in ("call", "conditional"):
        parts = [self.run(c) for c in ins.callees if c in module.computations]
        if parts:
          self._merge(e, max(parts, key=lambda part: part.step_s), 1)
      elif ins.opcode in work.KERNELS:
        done = None
        if ins.opcode == "fusion-start":
          done = next((d for d in instrs if ins.name in d.operands and
                       d.opcode == "fusion-done"), None)
        k = kernel(module, ins, shapes, rates, done)
        if k.seconds == 0.0:                    # inside a fused kernel costed elsewhere
          continue
        e.step_s += k.seconds
        e.compute_s += k.seconds
        e.kernels += 1
        self._add(e.compute_by, scope(k.source), k.seconds)
        self._add(e.by_category, k.category, k.seconds)
    self._memo[comp] = e
    return e


def estimate(hlo: str | Module, gpu: str = "h100", topology: str = "1x1x8",
             rates: Rates | None = None) -> Estimate:
  """The step time of a compiled program's scheduled HLO (`compiled.as_text()`) on `gpu`
  ('h100', 'h200': moejax.strategy.hardware's table) in `topology`."""
  module = parse(hlo) if isinstance(hlo, str) else hlo
  rates = rates or Rates.for_gpu(gpu, topology)
  e = _Walk(module, rates).run(module.entry)
  idle = rates.gpu.step_idle_s.value                # the host dispatches the step
  by_category = dict(e.by_category, idle=e.by_category["idle"] + idle)
  return dataclasses.replace(e, step_s=e.step_s + idle, comm_by=dict(e.comm_by),
                             exposed_by=dict(e.exposed_by), compute_by=dict(e.compute_by),
                             by_category=by_category)
