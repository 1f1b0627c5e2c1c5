"""A step-time estimate walked from XLA:GPU's schedule (jax exposes no estimate of XLA's
own: `cost_analysis()` is None for these programs and the latency-hiding scheduler's
estimates stay inside XLA).

The walk follows the scheduled HLO in order on two streams per computation: kernels
(fusions, custom calls) one after another on the compute stream, each by a roofline
(dot FLOPs at the profile's matmul rate, bytes read and written at its HBM rate, whichever
is longer, plus a launch); collectives by alpha-beta (the profile's per-call latency plus
bytes over its bandwidth: the NVLink preset inside a host, the cluster preset across hosts),
an async one on a communication stream from its start, the compute stream waiting at its
done only for what is left (exposed). A loop body counts its trip count times.
Limits: Pallas/Mosaic kernels' FLOPs are known only for the grouped matmul's shapes
([M, K] x [G, K, N]), others count bytes only; rates are sustained averages, not per-shape;
one communication stream (XLA may run several); no autotuning (the compile-only target has
no GPU), so GEMM choices and fusion may differ from a real compile.
"""

from __future__ import annotations

import dataclasses
import math
import re

from moejax.aot.gpus import Gpu, gpu as gpu_named, host_size
from moejax.aot.hlo import Instr, Module, op_name, parse
from moejax.aot.read import KINDS, _kind, first_group
from moejax.strategy.cost import PRESETS, HardwareProfile

KERNELS = ("fusion", "custom-call", "dot", "convolution", "copy", "sort", "scatter", "gather",
           "reduce", "transpose", "dynamic-slice", "dynamic-update-slice", "select-and-scatter")
LAUNCH_S = 2e-6          # per kernel: launch and tail (CUDA graphs would cut it)
# Bytes moved per byte of a collective's buffer, over a group of n (ring algorithms).
_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
           "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
           "ragged-all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0,
           "collective-broadcast": lambda n: 1.0}


@dataclasses.dataclass(frozen=True)
class Rates:
  flops_per_s: float
  hbm_bytes_per_s: float
  intra: HardwareProfile    # collectives within a host (NVLink)
  inter: HardwareProfile    # collectives across hosts
  per_host: int

  @classmethod
  def for_gpu(cls, name: str, topology: str) -> Rates:
    """The h100_node / h100_cluster presets (moejax.strategy.cost: public peaks x sustained
    fractions, the matmul fraction measured on one H100); HBM scaled to the GPU's peak."""
    node, cluster, g = PRESETS["h100_node"], PRESETS["h100_cluster"], gpu_named(name)
    scale = g.hbm_bytes_per_s / gpu_named("h100").hbm_bytes_per_s
    return cls(node.flops_per_s, node.mem_bytes_per_s * scale, node, cluster,
               host_size(topology))


@dataclasses.dataclass
class Estimate:
  step_s: float
  exposed_comm_s: float     # time the compute stream waited for collectives
  compute_s: float
  comm_s: float             # collective time, hidden or not
  # per collective label (`label`): its time, and the part the compute stream waited for
  comm_by: dict[str, float] = dataclasses.field(default_factory=dict)
  exposed_by: dict[str, float] = dataclasses.field(default_factory=dict)
  compute_by: dict[str, float] = dataclasses.field(default_factory=dict)   # per `scope`


def scope(line: str) -> str:
  """Which part of the model a kernel computes, by its op name: 'attention core' (scores,
  softmax and weighted values: jax.nn.dot_product_attention's vmapped ops, or the fused
  kernel), 'attention projections', 'moe' (the MoE layer, fsep's restores included), 'dense
  mlp', else 'other' (embedding, loss, optimizer, glue)."""
  op = op_name(line)
  if re.search(r"/attn[^/]*/(vmap\(|dot_product_attention|cudnn)", op):
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
  prof = rates.inter if crosses else rates.intra
  bw = prof.a2a_bytes_per_s if "all-to-all" in kind or kind.startswith("collective") else (
      prof.reduce_bytes_per_s)
  return prof.call_s(n) + _FACTOR[kind](n) * size / bw


def _dot_flops(ins: Instr, shapes: dict[str, Instr]) -> float:
  out = math.prod(d for _, dims in ins.arrays() for d in dims) if ins.arrays() else 0
  lhs = shapes.get(ins.operands[0]) if ins.operands else None
  dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line)
  if lhs is None or not dims or not lhs.arrays():
    return 0.0
  lhs_dims = lhs.arrays()[0][1]
  k = math.prod(lhs_dims[int(i)] for i in dims.group(1).split(",") if i)
  return 2.0 * out * k


def _flops(module: Module, comp: str, seen: set) -> float:
  """Dot FLOPs of a kernel's computation (and those it calls)."""
  if comp in seen or comp not in module.computations:
    return 0.0
  seen.add(comp)
  shapes, total = module.by_name(comp), 0.0
  for ins in module.computations[comp]:
    if ins.opcode in ("dot", "convolution"):
      total += _dot_flops(ins, shapes)
    for callee in ins.callees:
      total += _flops(module, callee, seen)
  return total


def _custom_call_flops(ins: Instr, shapes: dict[str, Instr]) -> float:
  """A grouped matmul's 2*M*K*N from its shapes: x [M, K], w [G, K, N] -> [M, N]; cuBLAS
  calls from their dot dimensions."""
  arrays = [shapes[o].arrays()[0][1] for o in ins.operands if o in shapes and shapes[o].arrays()]
  out = ins.arrays()[0][1] if ins.arrays() else ()
  if "gemm" in (ins.attr("custom_call_target") or "") and len(arrays) >= 2:
    m = re.search(r'"lhs_contracting_dimensions":\["(\d+)"', ins.line)
    k = arrays[0][int(m.group(1))] if m else arrays[0][-1]
    return 2.0 * math.prod(out) * k
  for x in arrays:
    for w in arrays:
      if len(x) == 2 and len(w) == 3 and x[1] == w[1] and len(out) == 2 and out == (x[0], w[2]):
        return 2.0 * x[0] * x[1] * w[2]
  return 0.0


def _kernel_bytes(module: Module, ins: Instr, shapes: dict[str, Instr]) -> int:
  """Bytes a kernel reads and writes: its result, and each operand, except that an operand
  the kernel only slices counts the slices (a loop body reading one layer of a stacked
  array reads that layer), and an in-place update counts the update."""
  total = ins.bytes()
  body = module.computations.get(ins.callees[0]) if ins.opcode == "fusion" and ins.callees \
      else None
  if body and body[-1].opcode == "dynamic-update-slice":
    # In place: the buffer (the operand shaped as the result) is neither read nor written
    # whole; the update is read and written.
    sizes = [shapes[o].bytes() for o in ins.operands if o in shapes]
    if total in sizes:
      sizes.remove(total)
    return 2 * sum(sizes)
  for i, name in enumerate(ins.operands):
    size = shapes[name].bytes() if name in shapes else 0
    if body is not None:
      param = next((p for p in body if p.opcode == "parameter" and f"parameter({i})" in p.line),
                   None)
      users = [u for u in body if param is not None and param.name in u.operands]
      if users and all(u.opcode in ("dynamic-slice", "slice", "gather") for u in users):
        size = min(size, sum(u.bytes() for u in users))
    total += size
  return total


class _Walk:
  def __init__(self, module: Module, rates: Rates):
    self.module, self.rates = module, rates
    self.compute_s = self.comm_s = 0.0
    self._memo: dict[str, tuple] = {}

  @staticmethod
  def _add(table: dict[str, float], key: str, value: float, times: float = 1) -> None:
    table[key] = table.get(key, 0.0) + value * times

  def kernel_s(self, ins: Instr, shapes: dict[str, Instr]) -> float:
    if ins.opcode == "custom-call":
      flops = _custom_call_flops(ins, shapes)
    elif ins.opcode in ("dot", "convolution"):
      flops = _dot_flops(ins, shapes)
    else:
      flops = sum(_flops(self.module, c, set()) for c in ins.callees)
    return LAUNCH_S + max(flops / self.rates.flops_per_s,
                          _kernel_bytes(self.module, ins, shapes) / self.rates.hbm_bytes_per_s)

  def run(self, comp: str) -> tuple:
    """(time, exposed communication, compute, communication, {label: communication},
    {label: exposed}, {scope: compute}) of one run of `comp`."""
    if comp in self._memo:
      return self._memo[comp]
    comm_by, exposed_by, compute_by = {}, {}, {}
    shapes = self.module.by_name(comp)
    t = exposed = compute = comm = 0.0
    comm_free, pending = 0.0, {}
    for ins in self.module.computations[comp]:
      kind = _kind(ins, self.module)
      if kind in KINDS:
        size = ins.bytes()
        if ins.opcode.endswith("-start"):
          done = next((d for d in self.module.computations[comp] if ins.name in d.operands and
                       d.opcode.endswith("-done")), None)
          size = max(done.bytes(), size - done.bytes()) if done is not None else size
        cost = collective_s(kind, size, ins.line, self.rates)
        comm += cost
        tag = label(kind, ins.line)
        self._add(comm_by, tag, cost)
        if ins.opcode.endswith("-start"):
          begin = max(t, comm_free)
          comm_free = begin + cost
          pending[ins.name] = (comm_free, tag)
        else:                                   # synchronous: on the compute stream
          start = max(t, comm_free)
          exposed += start + cost - t
          self._add(exposed_by, tag, start + cost - t)
          t = comm_free = start + cost
      elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in pending:
        finish, tag = pending.pop(ins.operands[0])
        if finish > t:
          exposed += finish - t
          self._add(exposed_by, tag, finish - t)
          t = finish
      elif ins.opcode == "while":
        body = ins.attr("body")
        n = ins.trip_count()
        n = 1 if n is None else n
        bt, be, bc, bm, b_comm, b_exposed, b_compute = self.run(body)
        for table, child in ((comm_by, b_comm), (exposed_by, b_exposed),
                             (compute_by, b_compute)):
          for key, value in child.items():
            self._add(table, key, value, n)
        t, exposed, compute, comm = t + n * bt, exposed + n * be, compute + n * bc, comm + n * bm
      elif ins.opcode in ("call", "conditional"):
        parts = [self.run(c) for c in ins.callees if c in self.module.computations]
        if parts:
          ct, ce, cc, cm, c_comm, c_exposed, c_compute = max(parts, key=lambda part: part[0])
          for table, child in ((comm_by, c_comm), (exposed_by, c_exposed),
                               (compute_by, c_compute)):
            for key, value in child.items():
              self._add(table, key, value)
          t, exposed, compute, comm = t + ct, exposed + ce, compute + cc, comm + cm
      elif ins.opcode in KERNELS:
        cost = self.kernel_s(ins, shapes)
        t += cost
        compute += cost
        self._add(compute_by, scope(ins.line), cost)
    self._memo[comp] = (t, exposed, compute, comm, comm_by, exposed_by, compute_by)
    return self._memo[comp]


def estimate(hlo: str | Module, gpu: str | Gpu = "h100", topology: str = "1x1x8",
             rates: Rates | None = None) -> Estimate:
  """The step time of a compiled program's scheduled HLO (`compiled.as_text()`)."""
  module = parse(hlo) if isinstance(hlo, str) else hlo
  name = gpu.name if isinstance(gpu, Gpu) else gpu
  rates = rates or Rates.for_gpu(name, topology)
  t, exposed, compute, comm, comm_by, exposed_by, compute_by = _Walk(module, rates).run(
      module.entry)
  return Estimate(t, exposed, compute, comm, comm_by, exposed_by, compute_by)
