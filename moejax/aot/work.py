"""What one kernel of a scheduled XLA:GPU program computes and moves, read from its HLO: the
FLOPs of every GEMM XLA:GPU emits (cuBLAS and cuBLASLt calls, Triton GEMM fusions, dots, the
Pallas/Mosaic grouped matmul by its shapes), the shape of cuDNN's fused attention, the bytes
a kernel reads and writes, and the category its time counts under (`category`).

The categories are the ones a measured kernel table can be split into as well
(moejax.aot.profile): a kernel's category follows from its HLO instruction alone, so the
estimate and the measurement are split by the same rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from moejax.aot.hlo import DTYPE_BYTES, Instr, Module
from moejax.aot.read import KINDS, collective_kind

CATEGORIES = ("gemm", "attention", "optimizer", "elementwise", "collectives", "idle")
# A kernel of these opcodes runs on the GPU (a fusion's body is one kernel; a fusion-start
# runs its body on another stream, as a kernel).
KERNELS = ("fusion", "fusion-start", "custom-call", "dot", "convolution", "copy", "sort",
           "scatter", "gather", "reduce", "transpose", "dynamic-slice", "dynamic-update-slice",
           "select-and-scatter")
# The attention core of jax.nn.dot_product_attention (its vmapped einsums and softmax under
# XLA, or the fused kernel's call), by the op name's path below an attention block.
_ATTENTION_CORE = re.compile(r"/attn[^/]*/(vmap\(|dot_product_attention|cudnn)")
# The train step's own ops outside the model (no forward or backward, not the model's
# hoisted tables, not the weights' cast to the compute dtype under vmap): the gradient's
# norm, the non-finite guard, the optimizer's update.
_MODEL_PATHS = ("jvp(", "transpose(", "/layers/", "vmap(", "/Transformer", "/LayerGroup")


@dataclasses.dataclass(frozen=True)
class Attention:
  """One call of cuDNN's fused attention: batch, query heads, query and key positions, head
  dim; FLOPs of the two matmuls of the forward (causal: the half below the diagonal), and
  the backward's 2.5 times that (it recomputes the scores)."""
  batch: int
  heads: int
  q_len: int
  kv_len: int
  head_dim: int
  causal: bool
  backward: bool

  @property
  def flops(self) -> float:
    fwd = 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim
    fwd *= 0.5 if self.causal else 1.0
    return 2.5 * fwd if self.backward else fwd


def _ints(text: str) -> list[int]:
  return [int(x) for x in re.findall(r"\d+", text)]


def _backend(ins: Instr) -> dict:
  """The instruction's backend_config (JSON), or {}."""
  m = re.search(r"backend_config=(\{.*\})\s*$", ins.line) or re.search(
      r"backend_config=(\{.*?\})(?:,\s*\w+=|$)", ins.line)
  if not m:
    return {}
  try:
    return json.loads(m.group(1))
  except ValueError:
    return {}


def _first_array(ins: Instr) -> tuple[str, tuple[int, ...]] | None:
  arrays = ins.arrays()
  return arrays[0] if arrays else None


def _operand_dims(ins: Instr, shapes: dict[str, Instr], i: int) -> tuple[int, ...] | None:
  if len(ins.operands) <= i or ins.operands[i] not in shapes:
    return None
  arrays = shapes[ins.operands[i]].arrays()
  return arrays[0][1] if arrays else None


def target(ins: Instr) -> str:
  return ins.attr("custom_call_target") or "" if ins.opcode == "custom-call" else ""


def is_library_gemm(ins: Instr) -> bool:
  """A cuBLAS or cuBLASLt call (`__cublas$gemm`, `__cublas$lt$matmul`, its fp8 form, ...):
  every custom call carrying a GEMM backend config."""
  return ins.opcode == "custom-call" and ("gemm_backend_config" in ins.line or
                                          "cublas" in target(ins) or "gemm" in target(ins))


def is_attention_call(ins: Instr) -> bool:
  return ins.opcode == "custom-call" and "$fmha" in target(ins)


def _dot_flops(ins: Instr, shapes: dict[str, Instr]) -> float:
  """2 x output elements x contracted size of an HLO `dot`."""
  out, lhs = _first_array(ins), _operand_dims(ins, shapes, 0)
  dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line)
  if out is None or lhs is None or not dims:
    return 0.0
  return 2.0 * math.prod(out[1]) * math.prod(lhs[i] for i in _ints(dims.group(1)))


def _library_gemm_flops(ins: Instr, shapes: dict[str, Instr]) -> float:
  """A cuBLAS(Lt) call's 2 x output elements x contracted size, from the dot dimensions in
  its backend config (the result is (output, workspace))."""
  out, lhs = _first_array(ins), _operand_dims(ins, shapes, 0)
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.line)
  if out is None or lhs is None:
    return 0.0
  k = math.prod(lhs[i] for i in _ints(m.group(1))) if m else lhs[-1]
  return 2.0 * math.prod(out[1]) * k


def grouped_matmul_flops(ins: Instr, shapes: dict[str, Instr]) -> float:
  """A Pallas/Mosaic call's FLOPs where its shapes are a grouped matmul's: x [M, K] by
  w [G, K, N] -> [M, N] (each row meets one group's weights), or its weight gradient x [M, K]
  by dy [M, N] -> [G, K, N]; 2 M K N either way. 0 for other custom calls and library ones."""
  if ins.opcode != "custom-call" or is_library_gemm(ins) or is_attention_call(ins):
    return 0.0
  arrays = [shapes[o].arrays()[0][1] for o in ins.operands if o in shapes and shapes[o].arrays()]
  out = _first_array(ins)
  out = out[1] if out else ()
  for x in arrays:
    for w in arrays:
      if len(x) == 2 and len(w) == 3 and x[1] == w[1] and len(out) == 2 and out == (x[0], w[2]):
        return 2.0 * x[0] * x[1] * w[2]
      if (len(x) == len(w) == 2 and x is not w and x[0] == w[0] and len(out) == 3 and
              out[1:] == (x[1], w[1])):
        return 2.0 * x[0] * x[1] * w[1]
  return 0.0


def _mnk(lhs: tuple[int, ...], out: tuple[int, ...], batch: list[int],
         contracting: list[int]) -> tuple[int, int, int]:
  k = math.prod(lhs[i] for i in contracting)
  m = math.prod(d for i, d in enumerate(lhs) if i not in contracting + batch)
  return m, math.prod(out) // max(m * math.prod(lhs[i] for i in batch), 1), k


def gemm_dims(module: Module, ins: Instr, shapes: dict[str, Instr]) -> tuple[int, ...]:
  """(M, N, K) of a GEMM kernel: a library call's (from its dot dimensions), a dot's, or the
  first dot of a fusion's body; () where it runs none."""
  if is_library_gemm(ins):
    lhs, out = _operand_dims(ins, shapes, 0), _first_array(ins)
    dims = re.search(r'"lhs_batch_dimensions":\[([^\]]*)\],"lhs_contracting_dimensions":'
                     r'\[([^\]]*)\]', ins.line)
    if lhs is None or out is None or not dims:
      return ()
    return _mnk(lhs, out[1], _ints(dims.group(1)), _ints(dims.group(2)))
  dots = [(ins, shapes)] if ins.opcode == "dot" else [
      (d, module.by_name(c)) for c in ins.callees if c in module.computations
      for d in module.computations[c] if d.opcode == "dot"]
  for dot, where in dots:
    lhs, out = _operand_dims(dot, where, 0), _first_array(dot)
    if lhs is None or out is None:
      continue
    field = lambda key, line=dot.line: _ints((re.search(rf"{key}=\{{([\d,]*)\}}", line) or
                                               [None, ""])[1])
    return _mnk(lhs, out[1], field("lhs_batch_dims"), field("lhs_contracting_dims"))
  return ()


def body_flops(module: Module, comp: str, seen: set | None = None) -> float:
  """Dot FLOPs of a kernel's computation (and of those it calls)."""
  seen = set() if seen is None else seen
  if comp in seen or comp not in module.computations:
    return 0.0
  seen.add(comp)
  shapes, total = module.by_name(comp), 0.0
  for ins in module.computations[comp]:
    if ins.opcode in ("dot", "convolution"):
      total += _dot_flops(ins, shapes)
    for callee in ins.callees:
      total += body_flops(module, callee, seen)
  return total


def flops(module: Module, ins: Instr, shapes: dict[str, Instr]) -> float:
  """The matmul FLOPs of one kernel (0 for an elementwise one and for attention calls)."""
  if ins.opcode in ("dot", "convolution"):
    return _dot_flops(ins, shapes)
  if is_library_gemm(ins):
    return _library_gemm_flops(ins, shapes)
  if ins.opcode == "custom-call":
    return grouped_matmul_flops(ins, shapes)
  return sum(body_flops(module, c) for c in ins.callees)


def attention(ins: Instr, shapes: dict[str, Instr]) -> Attention | None:
  """The shape of a cuDNN fused-attention call (`__cudnn$fmha...`), else None. Q is
  operand 0 and K operand 1; the first matmul's batch dims are (batch, heads)."""
  if not is_attention_call(ins):
    return None
  q, k = _operand_dims(ins, shapes, 0), _operand_dims(ins, shapes, 1)
  key = "bmm1_grad_gemm2_dot_dimension_numbers" if "Backward" in target(ins) else (
      "bmm1_dot_dimension_numbers")
  dims = (_backend(ins).get("cudnn_fmha_backend_config") or {}).get(key)
  if q is None or k is None:
    return None
  if dims and "Backward" not in target(ins):
    qb, qc = [int(x) for x in dims["lhs_batch_dimensions"]], [
        int(x) for x in dims["lhs_contracting_dimensions"]]
    kb, kc = [int(x) for x in dims["rhs_batch_dimensions"]], [
        int(x) for x in dims["rhs_contracting_dimensions"]]
  else:                                  # the layout of the forward's operands: B, S, H, D
    qb, qc, kb, kc = [0, 2], [3], [0, 2], [3]
  q_len = math.prod(d for i, d in enumerate(q) if i not in qb + qc)
  kv_len = math.prod(d for i, d in enumerate(k) if i not in kb + kc)
  causal = "CAUSAL" in ins.line or '"is_causal_mask":true' in ins.line
  return Attention(q[qb[0]], q[qb[1]], q_len, kv_len, math.prod(q[i] for i in qc), causal,
                   "Backward" in target(ins))


def _result_bytes(ins: Instr) -> int:
  """Bytes of the result, less a library call's workspace (its s8/u8 scratch buffer)."""
  if ins.opcode != "custom-call":
    return ins.bytes()
  return sum(DTYPE_BYTES[t] * math.prod(d) for t, d in ins.arrays() if t not in ("s8", "u8"))


def _consumers(body: list[Instr], name: str) -> list[Instr]:
  """The instructions that read `name` in a kernel's body, looking through bitcasts (views:
  no bytes move)."""
  found = []
  for user in (u for u in body if name in u.operands):
    found += _consumers(body, user.name) if user.opcode == "bitcast" else [user]
  return found


def kernel_bytes(module: Module, ins: Instr, shapes: dict[str, Instr],
                 result: Instr | None = None) -> int:
  """Bytes a kernel reads and writes: its result, and each operand, except that an operand
  the kernel only slices or gathers from counts what it takes (a loop body reading one layer
  of a stacked array reads that layer), and an in-place update (dynamic-update-slice,
  scatter) counts the update read and written, not the buffer. `result`: the instruction
  whose shape is the kernel's output (a fusion-start's done)."""
  total = result.bytes() if result is not None else _result_bytes(ins)
  body = module.computations.get(ins.callees[0]) if (
      ins.opcode in ("fusion", "fusion-start") and ins.callees) else None
  root = body[-1] if body else None
  if root is not None and root.opcode in ("dynamic-update-slice", "scatter"):
    # In place: the buffer (the operand shaped as the result) is neither read nor written
    # whole; the update (a scatter's: its updates operand, in the result's type) is read
    # and written.
    sizes = [shapes[o].bytes() for o in ins.operands if o in shapes]
    if total in sizes:
      sizes.remove(total)
    if root.opcode == "dynamic-update-slice":
      return 2 * sum(sizes)
    by_name = {i.name: i for i in body}
    updates = by_name.get(root.operands[2]) if len(root.operands) > 2 else None
    return sum(sizes) + (updates.bytes() if updates is not None else sum(sizes))
  for i, name in enumerate(ins.operands):
    size = shapes[name].bytes() if name in shapes else 0
    if body is not None:
      param = next((p for p in body if p.opcode == "parameter" and f"parameter({i})" in p.line),
                   None)
      users = _consumers(body, param.name) if param is not None else []
      if users and all(u.opcode in ("dynamic-slice", "slice", "gather") for u in users):
        size = min(size, sum(u.bytes() for u in users))
    total += size
  return total


MEMORY_KINDS = ("stream", "copy", "fill", "reduce", "scatter", "gather", "sort")


def _hero(body: list[Instr]) -> Instr:
  """The op a fusion is built around: its root, looking through views and tuples."""
  by_name = {i.name: i for i in body}
  hero = body[-1]
  while hero.opcode in ("bitcast", "tuple", "convert", "copy") and hero.operands and (
      hero.operands[0] in by_name):
    hero = by_name[hero.operands[0]]
  return hero


def memory_kind(module: Module, ins: Instr) -> str:
  """How a kernel moves its bytes, which sets the rate it moves them at (GPU_RATES):
  'sort' (a sort of any kind: XLA's, CUB's); 'scatter' (atomic adds); 'gather' (rows
  fetched by index); 'copy' (a copy, an async slice: memcpy); 'fill' (writes only: a zero
  or constant fill); 'reduce' (a reduction); else 'stream' (elementwise, converts,
  in-place updates)."""
  if "sort" in target(ins) or ins.opcode == "sort":
    return "sort"
  body = module.computations.get(ins.callees[0]) if (
      ins.opcode in ("fusion", "fusion-start") and ins.callees) else None
  if ins.opcode in ("copy", "dynamic-slice"):
    return "copy"
  if ins.opcode in ("scatter", "gather"):
    return ins.opcode
  if not body:
    return "stream"
  hero = _hero(body)
  if hero.opcode in ("sort", "scatter", "gather"):
    return hero.opcode
  if ins.opcode == "fusion-start" and hero.opcode in ("dynamic-slice", "slice"):
    return "copy"
  if not ins.operands:
    return "fill"
  if "kind=kInput" in ins.line or hero.opcode == "reduce":
    return "reduce"
  return "stream"


def is_scatter(module: Module, ins: Instr) -> bool:
  return memory_kind(module, ins) == "scatter"


def is_gemm_fusion(module: Module, ins: Instr) -> bool:
  """A fusion XLA:GPU emits as a GEMM (Triton or cuBLAS), not as a loop or reduction that
  happens to contain a small dot."""
  if ins.opcode != "fusion":
    return False
  config = _backend(ins).get("fusion_backend_config") or {}
  kind = config.get("kind", "")
  return ("gemm" in kind or "cublas" in kind or ins.name.startswith("gemm_fusion") or
          ("kind=kCustom" in ins.line and body_flops(module, ins.callees[0]) > 0
           if ins.callees else False))


def in_attention_core_name(op: str) -> bool:
  """Whether a JAX op name lies in an attention block's core (scores, softmax, weighted
  values)."""
  return bool(_ATTENTION_CORE.search(op))


def source_name(module: Module, ins: Instr) -> str:
  """The JAX op name of what a kernel computes: its own, or for a fusion XLA left unnamed
  (the softmax reductions of an unfused attention core among them) that of the named
  instruction nearest its fused computation's root, walking back through operands."""
  if (name := ins.op_name) or ins.opcode not in ("fusion", "fusion-start"):
    return name
  for callee in ins.callees:
    body = module.computations.get(callee, ())
    inner = {i.name: i for i in body}
    root = next((i for i in body if i.line.lstrip().startswith("ROOT ")), None)
    frontier, seen = [root.name] if root else [], set()
    while frontier:
      step = []
      for n in frontier:
        if n in seen or n not in inner:
          continue
        seen.add(n)
        if inner[n].op_name:
          return inner[n].op_name
        step.extend(inner[n].operands)
      frontier = step
  return ""


def category(module: Module, ins: Instr, shapes: dict[str, Instr],
             source: str | None = None) -> str:
  """The category a kernel's time counts under: 'collectives'; 'attention' (cuDNN's fused
  call, or XLA's unfused attention core by its op name); 'gemm' (library GEMMs, GEMM
  fusions, dots, a Pallas/Mosaic grouped matmul); 'optimizer' (the step's own ops after the
  backward: the gradient norm, the non-finite guard, the update); else 'elementwise'
  (elementwise and reduction fusions, copies, gathers, scatters, sorts, zero fills).
  `source`: the kernel's `source_name` where the caller has it already."""
  if collective_kind(ins, module) in KINDS:
    return "collectives"
  op = source_name(module, ins) if source is None else source
  if is_attention_call(ins) or in_attention_core_name(op):
    return "attention"
  if ins.opcode in ("dot", "convolution") or is_library_gemm(ins) or is_gemm_fusion(module, ins):
    return "gemm"
  if grouped_matmul_flops(ins, shapes) > 0:
    return "gemm"
  if op.startswith("jit(train_step)/") and not any(p in op for p in _MODEL_PATHS):
    return "optimizer"
  return "elementwise"

