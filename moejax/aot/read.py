"""What XLA:GPU made of a program, read from its scheduled HLO: the collectives (per kind:
executions per step and bytes), which of them run asynchronously (a start/done pair) and
which of those have compute scheduled between start and done (overlapped), and the
custom-call kernels. Bytes are per GPU and per step: a collective inside the layer loop
counts once per iteration. A collective's bytes are its larger buffer (an all-gather's
output, a reduce-scatter's input)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

from moejax.aot.hlo import Instr, Module, parse

KINDS = ("all-to-all", "ragged-all-to-all", "all-reduce", "all-gather", "reduce-scatter",
         "collective-permute", "collective-broadcast")
# What a GPU computes: kernels (fusions, library and Pallas calls) and what runs them.
COMPUTE = ("fusion", "custom-call", "dot", "convolution", "while", "conditional", "call")


@dataclasses.dataclass
class Collective:
  kind: str
  computation: str
  name: str
  bytes: int            # per execution
  runs: int             # executions per step
  is_async: bool
  compute_between: list[str]   # compute instructions scheduled between start and done
  op_name: str          # the JAX source path (metadata), e.g. .../fsep_restore/all_to_all
  group_size: int

  @property
  def overlapped(self) -> bool:
    return self.is_async and bool(self.compute_between)

  @property
  def backward(self) -> bool:
    return "transpose(" in self.op_name


def collective_kind(ins: Instr, module: Module) -> str | None:
  """The collective an instruction starts or runs (an async wrapper's inner one), else None."""
  op = ins.opcode.removesuffix("-start")
  if op in KINDS:
    return op
  if ins.opcode == "async-start":             # a collective wrapped in an async computation
    for callee in ins.callees:
      for inner in module.computations.get(callee, []):
        if inner.opcode in KINDS:
          return inner.opcode
  return None


def group_size(line: str) -> int:
  """Devices in one group of a collective: its replica groups in any of XLA's three spellings
  ({{0,4},{1,5}}, [4,2]<=[8], mesh['axis_0'=2,...] {'axis_0'}, the last also with
  device_ids=(...) before its reduced axes); a collective permute's is 2 when it moves data
  between devices, 1 when every pair is a device to itself."""
  if m := re.search(r"source_target_pairs=\{(.*?)\}\}", line):
    pairs = re.findall(r"\{(\d+),(\d+)", m.group(1) + "}")
    return 2 if any(a != b for a, b in pairs) else 1
  if (group := first_group(line)) is None:
    raise ValueError(f"no replica groups read in: {line[:200]}")
  return max(1, len(group))


def first_group(line: str) -> list[int] | None:
  """The device ids of a collective's first group: its replica groups in any of XLA's three
  spellings, or a collective permute's first (source, target) pair; None where it has none."""
  if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
    return [int(x) for x in m.group(1).split(",") if x]
  if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
    ids = np.arange(math.prod(int(x) for x in m.group(3).split(",")))
    ids = ids.reshape([int(x) for x in m.group(3).split(",")])
    if m.group(4):
      ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2)))[0].tolist()
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\]([^{]*)\{([^}]*)\}", line):
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    sizes = [int(s) for _, s in axes]
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    if d := re.search(r"device_ids=\(([\d,]+)\)", m.group(2)):
      ids = np.array([int(x) for x in d.group(1).split(",")]).reshape(sizes)
    names = [a for a, _ in axes]
    reduced = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(3))]
    keep = [i for i in range(len(names)) if i not in reduced]
    return ids.transpose(keep + reduced).reshape(-1, math.prod(sizes[i] for i in reduced))[0]\
        .tolist()
  if m := re.search(r"source_target_pairs=\{\{(\d+),(\d+)\}", line):
    return [int(m.group(1)), int(m.group(2))]
  return None


def _group_or_one(line: str) -> int:
  """`group_size`, or 1 for a collective whose groups are not spelled out (all devices in
  one group of the program's own; the estimate then charges no transfer)."""
  try:
    return group_size(line)
  except ValueError:
    return 1


def collectives(module: Module | str) -> list[Collective]:
  """Every collective of the program that runs, in schedule order per computation."""
  module = parse(module) if isinstance(module, str) else module
  runs, found = module.runs(), []
  for comp, count in runs.items():
    instrs = module.computations[comp]
    position = {ins.name: i for i, ins in enumerate(instrs)}
    for i, ins in enumerate(instrs):
      kind = collective_kind(ins, module)
      if kind is None:
        continue
      between, size = [], ins.bytes()
      is_async = ins.opcode.endswith("-start")
      if is_async:
        done = next((d for d in instrs[i + 1:] if ins.name in d.operands and
                     d.opcode.endswith("-done")), None)
        if done is not None:
          size = max(done.bytes(), size - done.bytes())   # start: (operands, outputs)
          between = [x.name for x in instrs[i + 1:position[done.name]] if x.opcode in COMPUTE]
      found.append(Collective(kind, comp, ins.name, size, count, is_async, between,
                              ins.op_name, _group_or_one(ins.line)))
  return found


def collective_summary(found: list[Collective]) -> dict[str, dict[str, int]]:
  """{kind: {"count": executions per step, "bytes": bytes per step}}."""
  out = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for c in found:
    out[c.kind]["count"] += c.runs
    out[c.kind]["bytes"] += c.runs * c.bytes
  return dict(sorted(out.items()))


def _fraction(found: list[Collective], keep) -> float:
  total = sum(c.runs * c.bytes for c in found)
  return sum(c.runs * c.bytes for c in found if keep(c)) / total if total else 1.0


def async_bytes_fraction(found: list[Collective]) -> float:
  """Share of the collective bytes that move asynchronously (1.0 if there are none)."""
  return _fraction(found, lambda c: c.is_async)


def overlapped_bytes_fraction(found: list[Collective]) -> float:
  """Share of the collective bytes that move asynchronously with compute scheduled between
  start and done (1.0 if there are none)."""
  return _fraction(found, lambda c: c.overlapped)


def kernels(module: Module | str) -> dict[str, int]:
  """{custom-call target: calls per step}; a Triton call is named by its kernel
  (`triton:NAME`), so that each Pallas kernel shows."""
  module = parse(module) if isinstance(module, str) else module
  counts = collections.Counter()
  runs = module.runs()
  for comp, instrs in module.computations.items():
    for ins in instrs:
      if ins.opcode != "custom-call":
        continue
      target = ins.attr("custom_call_target") or "?"
      if "triton" in target and (m := re.search(r'(?:"name":|\bname = )"([^"]+)"', ins.line)):
        target = f"triton:{m.group(1)}"
      counts[target] += runs[comp] if comp in runs else runs_of_caller(module, comp, runs)
  return dict(sorted(counts.items()))


def runs_of_caller(module: Module, comp: str, runs: dict[str, int]) -> int:
  """Runs of a kernel computation (a fusion's body): its caller's."""
  for caller, instrs in module.computations.items():
    if caller in runs and any(comp in ins.callees for ins in instrs):
      return runs[caller]
  return 1
