"""A measured kernel table beside the schedule estimate of the same program, category by
category (moejax.aot.work.CATEGORIES).

A kernel table is what `benchmarks.gpu.on_gpu` writes per profiled train step
(`kernel_profiles.json.gz`): per kernel, its name, the HLO op the profiler tags it with, the
module, microseconds and launches per step, and the step's busy time (the union of kernel
intervals). A kernel's category comes from its HLO instruction, by the same rule the estimate
uses (moejax.aot.work.category): XLA names a fusion's kernel after the instruction ('.' and
'-' as '_'; a sort's extra kernels add '__N'), and a kernel launched outside a command buffer
is tagged with its instruction. Library kernels inside a command buffer, which the profiler
tags only with the buffer, go by their library: cuBLAS(Lt) (nvjet, cutlass, xmma) to 'gemm',
cuDNN to 'attention', NCCL to 'collectives', copies and memsets to 'elementwise'. 'idle' is
the measured step less the GPU's busy time.

  python -m moejax.aot.profile KERNEL_PROFILES.json.gz STEP_HLOS.json.gz ON_GPU.json --gpu h200
  [--rates]

prints, per profiled step, each category's estimate, measurement and error (ON_GPU.json: the
run's result, whose `schedule_estimate` rows hold the measured steps), and with --rates the
rates the table (moejax.strategy.hardware) reads off these kernel tables.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import sys

from moejax.aot import work
from moejax.aot.estimate import Estimate, estimate
from moejax.aot.hlo import Instr, Module, parse
from moejax.runtime.cli import ArgumentParser, fail
from moejax.strategy.hardware import GPU_RATES

_LIBRARIES = ((re.compile(r"nccl", re.I), "collectives"),
              (re.compile(r"cudnn"), "attention"),
              (re.compile(r"^(nvjet|cutlass|sm\d+_xmma|void cutlass|.*gemm)", re.I), "gemm"),
              (re.compile(r"^(memcpy|Memcpy|Memset)"), "elementwise"))


def kernel_name(instruction: str) -> str:
  """The name XLA gives the kernel of an instruction ('loop_add_fusion.7' ->
  'loop_add_fusion_7')."""
  return re.sub(r"[.\-]", "_", instruction)


@dataclasses.dataclass
class Measured:
  """Seconds per step by category, and the kernels no instruction was found for."""
  by_category: dict[str, float]
  unmatched_s: float
  launches: float


def _instructions(module: Module) -> dict[str, tuple[Instr, dict[str, Instr]]]:
  """Every instruction by its kernel name and by its own name, with its computation's
  instructions by name."""
  found = {}
  for comp, instrs in module.computations.items():
    shapes = module.by_name(comp)
    for ins in instrs:
      found[kernel_name(ins.name)] = (ins, shapes)
      found[ins.name] = (ins, shapes)
  return found


def kernel_category(name: str, hlo_op: str, module: Module,
                    instructions: dict[str, tuple[Instr, dict[str, Instr]]]) -> str | None:
  """The category of one measured kernel, None where neither its name nor its op says."""
  for pattern, category in _LIBRARIES:
    if pattern.search(name) and not name.startswith(("gemm_fusion", "loop_", "input_")):
      return category
  for key in (re.sub(r"__\d+$", "", name), hlo_op):
    if key in instructions:
      ins, shapes = instructions[key]
      return work.category(module, ins, shapes)
  return None


def measured(profile: dict, module: Module, step_s: float) -> Measured:
  """`profile` (one shape's entry of kernel_profiles.json.gz: 'kernels' rows of [name, hlo
  op, module, us per step, launches per step] and 'busy_us_per_step') by category, with
  `step_s` the measured step time (its idle: step less busy)."""
  instructions = _instructions(module)
  by = {c: 0.0 for c in work.CATEGORIES}
  unmatched = launches = 0.0
  for name, hlo_op, _, us, count in profile["kernels"]:
    category = kernel_category(name, hlo_op, module, instructions)
    if category is None:
      unmatched += us * 1e-6
      category = "elementwise"
    by[category] += us * 1e-6
    launches += count
  by["idle"] = max(step_s - profile["busy_us_per_step"] * 1e-6, 0.0)
  return Measured(by, unmatched, launches)


def compare(estimate: Estimate, measurement: Measured, step_s: float) -> dict[str, dict]:
  """{category and 'step': {'estimate_s', 'measured_s', 'error'}}: error is estimate over
  measured less one (None where nothing was measured)."""
  rows = {}
  pairs = [(c, estimate.by_category.get(c, 0.0), measurement.by_category[c])
           for c in work.CATEGORIES] + [("step", estimate.step_s, step_s)]
  for name, est, meas in pairs:
    rows[name] = {"estimate_s": est, "measured_s": meas,
                  "error": est / meas - 1 if meas > 0 else None}
  return rows


@dataclasses.dataclass
class Work:
  """What a program's kernels of one kind did in a step, beside the time they took: FLOPs
  (GEMMs, attention), bytes (memory kinds) or calls (sorts)."""
  amount: float = 0.0
  seconds: float = 0.0

  @property
  def rate(self) -> float:
    return self.amount / self.seconds if self.seconds else 0.0


def kernels_by_instruction(module: Module) -> list[tuple[Instr, dict[str, Instr], float,
                                                          Instr | None]]:
  """Every kernel instruction that runs, with its computation's shapes, its runs per step and
  its fusion-done (for a fusion-start)."""
  found = []
  for comp, runs in module.runs().items():
    instrs, shapes = module.computations[comp], module.by_name(comp)
    for ins in instrs:
      if ins.opcode in work.KERNELS:
        done = next((d for d in instrs if ins.name in d.operands and d.opcode == "fusion-done"),
                    None) if ins.opcode == "fusion-start" else None
        found.append((ins, shapes, runs, done))
  return found


def measured_work(profile: dict, module: Module) -> dict[str, Work]:
  """Per kind of kernel (GEMMs, attention forward and backward by head dim and sequence,
  each memory kind of moejax.aot.work.memory_kind), the work of the program's HLO per step
  beside the measured time of its kernels: the rates GPU_RATES reads off a kernel table.
  Library kernels count by their library (cuBLAS: 'gemm'; cuDNN's forward: 'attention
  fwd D S', its other kernels: 'attention bwd D S'; copies and memsets: 'copy'); an XLA
  kernel by its instruction's kind."""
  instructions = _instructions(module)
  table: dict[str, Work] = {}
  shape_of_attention = None

  def add(kind: str, amount: float = 0.0, seconds: float = 0.0) -> None:
    w = table.setdefault(kind, Work())
    w.amount += amount
    w.seconds += seconds

  for ins, shapes, runs, done in kernels_by_instruction(module):
    if (attn := work.attention(ins, shapes)) is not None:
      shape_of_attention = (attn.head_dim, attn.kv_len)
      add(f"attention {'bwd' if attn.backward else 'fwd'} {attn.head_dim} {attn.kv_len}",
          attn.flops * runs)
    elif work.category(module, ins, shapes) == "gemm":
      add("gemm", work.flops(module, ins, shapes) * runs)
    elif (kind := work.memory_kind(module, ins)) == "sort":
      add("sort", runs)
    else:
      add(kind, work.kernel_bytes(module, ins, shapes, done) * runs)
  for name, hlo_op, _, us, _ in profile["kernels"]:
    category = kernel_category(name, hlo_op, module, instructions)
    key = re.sub(r"__\d+$", "", name)
    if category == "attention" and shape_of_attention is not None:
      d, s = shape_of_attention
      add(f"attention {'fwd' if 'fprop' in name else 'bwd'} {d} {s}", seconds=us * 1e-6)
    elif category == "gemm":
      add("gemm", seconds=us * 1e-6)
    elif name.startswith(("memcpy", "Memcpy", "Memset")) and key not in instructions:
      add("copy", seconds=us * 1e-6)
    elif key in instructions or hlo_op in instructions:
      ins, _ = instructions[key] if key in instructions else instructions[hlo_op]
      add(work.memory_kind(module, ins), seconds=us * 1e-6)
  return table


def _read(path: str):
  with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
    return json.load(f)


def comparisons(profiles: dict, hlos: dict, steps: dict[str, float], gpu: str,
                ) -> dict[str, dict[str, dict]]:
  """{step name: `compare` rows} for every profiled step with its HLO and measured time."""
  out = {}
  for name, prof in profiles.items():
    if name in hlos and name in steps:
      module = parse(hlos[name])
      out[name] = compare(estimate(module, gpu, "1x1x1"), measured(prof, module, steps[name]),
                          steps[name])
  return out


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="python -m moejax.aot.profile",
                     description="The schedule estimate of each profiled train step's HLO "
                                 "beside its measured kernel table, category by category.")
  p.add_argument("profiles", help="The kernel_profiles.json.gz of a benchmarks.gpu.on_gpu run.")
  p.add_argument("hlos", help="The step_hlos.json.gz of the same run.")
  p.add_argument("result", help="The run's on_gpu JSON, whose schedule_estimate rows hold the "
                                "measured steps.")
  p.add_argument("--gpu", default="h200", choices=sorted(GPU_RATES),
                 help="The GPU whose rates the estimate takes (moejax.strategy.hardware).")
  p.add_argument("--rates", action="store_true",
                 help="Also print the rates the kernel tables give, all steps together.")
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  try:
    profiles, hlos, result = _read(args.profiles), _read(args.hlos), _read(args.result)
    steps = {r["shape"]: r["measured_step_s"]
             for r in result["steps"]["schedule_estimate"]["rows"]}
  except (OSError, ValueError, KeyError) as e:
    return fail(f"cannot read the run's files ({type(e).__name__}: {e}); pass a "
                "benchmarks.gpu.on_gpu run's kernel_profiles.json.gz, step_hlos.json.gz and JSON.")
  for name, rows in comparisons(profiles, hlos, steps, args.gpu).items():
    print(f"{name}: ms estimated / measured (error)")
    for category, r in rows.items():
      error = "" if r["error"] is None else f"{r['error']:+7.1%}"
      print(f"  {category:<12}{r['estimate_s'] * 1e3:10.2f}{r['measured_s'] * 1e3:10.2f}  {error}")
  if args.rates:
    total: dict[str, Work] = {}
    for name, prof in profiles.items():
      if name in hlos:
        for kind, w in measured_work(prof, parse(hlos[name])).items():
          t = total.setdefault(kind, Work())
          t.amount, t.seconds = t.amount + w.amount, t.seconds + w.seconds
    print("rates, all steps together (FLOP/s, bytes/s; sort: seconds per call)")
    for kind, w in sorted(total.items()):
      value = w.seconds / w.amount if kind == "sort" and w.amount else w.rate
      print(f"  {kind:<24}{value:12.4g}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
