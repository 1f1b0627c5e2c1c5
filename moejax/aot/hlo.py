"""XLA's HLO text as data: computations in schedule order, each instruction with its opcode,
result shapes, operands, called computations and attributes; how often each computation runs
per step (while loops' known trip counts). Reads the optimised (scheduled) text and the text
as lowered (`as_text(dialect="hlo")`: names without %, computations without signatures)."""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_INSTR = re.compile(r"\s+(?:ROOT )?(%?)([\w.\-]+) = (.*)$")
# A conditional names its branches either as `branch_computations={...}` (read in `parse`) or,
# with two, as `true_computation=` and `false_computation=`.
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)")
_HEADER = re.compile(r"(?:ENTRY )?%?([\w.\-]+) [({]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def op_name(line: str) -> str:
  """The JAX source path an instruction's metadata names (e.g. .../moe/shard_map/mul), or ''."""
  m = _OP_NAME.search(line)
  return m.group(1) if m else ""


@dataclasses.dataclass
class Instr:
  name: str
  opcode: str
  shape: str            # the result's shape text (a tuple's too)
  operands: list[str]
  callees: list[str]
  line: str

  def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in the result's shape (a tuple's each)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in _SHAPE.findall(self.shape) if t in DTYPE_BYTES]

  def bytes(self) -> int:
    return sum(DTYPE_BYTES[t] * math.prod(d) for t, d in self.arrays())

  def attr(self, key: str) -> str | None:
    m = re.search(rf"\b{key}=(\"[^\"]*\"|\{{[^}}]*\}}|[^,\s]+)", self.line)
    return m.group(1).strip('"').lstrip('%') if m else None

  @property
  def op_name(self) -> str:
    return op_name(self.line)

  def trip_count(self) -> int | None:
    """A while loop's known trip count (None where XLA knows none)."""
    m = re.search(r'known_trip_count":\{"n":"(\d+)"', self.line)
    return int(m.group(1)) if m else None


def _split_rhs(rhs: str) -> tuple[str, str, str]:
  """(shape, opcode, the rest after the opening parenthesis) of an instruction's right side."""
  if rhs.startswith("("):                     # a tuple shape: skip its balanced parentheses
    depth = 0
    for i, c in enumerate(rhs):
      depth += {"(": 1, ")": -1}.get(c, 0)
      if depth == 0:
        shape, rest = rhs[:i + 1], rhs[i + 1:]
        break
  else:
    shape, _, rest = rhs.partition(" ")
  m = re.match(r"\s*([\w\-]+)\((.*)$", rest)
  return shape, m.group(1), m.group(2)


def _operands(args: str, lowered: bool) -> list[str]:
  """The operand names in `args` (up to the balanced closing parenthesis); `lowered`: names
  without %, separated by commas."""
  depth = 1
  for end, c in enumerate(args):
    depth += {"(": 1, ")": -1}.get(c, 0)
    if depth == 0:
      args = args[:end]
      break
  if lowered:
    return [a.strip() for a in args.split(",") if a.strip()]
  return re.findall(r"%([\w.\-]+)", args)


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instr]]    # in schedule order
  entry: str

  def by_name(self, comp: str) -> dict[str, Instr]:
    return {i.name: i for i in self.computations[comp]}

  def runs(self) -> dict[str, int]:
    """Per step, how often each control-flow computation (entry, loop bodies, branches,
    called computations) runs: a loop body its trip count times its caller's runs (an
    unknown trip count counts once), a branch as often as its conditional."""
    runs = {self.entry: 1}
    stack = [self.entry]
    while stack:
      comp = stack.pop()
      for ins in self.computations[comp]:
        if ins.opcode in ("fusion", "fusion-start", "reduce", "all-reduce-start", "all-reduce",
                          "sort", "scatter", "map", "reduce-window", "select-and-scatter",
                          "reduce-scatter"):
          continue                                    # computations of one kernel
        trip = ins.trip_count() if ins.opcode == "while" else 1
        trip = 1 if trip is None else trip
        for callee in ins.callees:
          if callee in self.computations and callee not in runs:
            runs[callee] = runs[comp] * (1 if callee == ins.attr("condition") else trip)
            stack.append(callee)
    return runs


def parse(text: str) -> Module:
  comps, current, entry = {}, None, None
  for line in text.splitlines():
    if line.endswith("{") and not line.startswith(" ") and (h := _HEADER.match(line)):
      current = comps.setdefault(name := h.group(1), [])
      if line.startswith("ENTRY"):
        entry = name
    elif current is not None and (m := _INSTR.match(line)):
      shape, opcode, args = _split_rhs(m.group(3))
      callees = _CALLS.findall(line)
      for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        callees += re.findall(r"%?([\w.\-]+)", group)
      current.append(Instr(m.group(2), opcode, shape, _operands(args, not m.group(1)), callees,
                           line))
  return Module(comps, entry)
