"""What the tests ask of XLA's HLO text beyond what the library reads (moejax.aot.hlo parses
it, moejax.aot.read finds the collectives): which collectives wait for which matmuls, how
many messages a pipeline's tick loops send, and how many calls each collective makes."""

from __future__ import annotations

from moejax.aot import read
from moejax.aot.hlo import Instr, Module, parse

STAGE_COLLECTIVES = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter")


def has_dot(module: Module, name: str, seen=None) -> bool:
  """Whether computation `name` (or one it calls) contains a dot or convolution."""
  seen = set() if seen is None else seen
  if name in seen or name not in module.computations:
    return False
  seen.add(name)
  return any(ins.opcode in ("dot", "convolution") or
             any(has_dot(module, c, seen) for c in ins.callees)
             for ins in module.computations[name])


def depends_on(comp: dict[str, Instr], name: str, pred) -> Instr | None:
  """The first instruction of `comp` (by name, as `Module.by_name` gives it) that `name`
  depends on through its operands (transitively) and that satisfies `pred(instr)`, or None."""
  stack, seen = list(comp[name].operands), set()
  while stack:
    op = stack.pop()
    if op in seen or op not in comp:
      continue
    seen.add(op)
    if pred(comp[op]):
      return comp[op]
    stack.extend(comp[op].operands)
  return None


def _without_leading_ones(dims) -> tuple[int, ...]:
  dims = tuple(dims)
  while dims and dims[0] == 1:
    dims = dims[1:]
  return dims


def array_dims(ins: Instr) -> list[tuple[int, ...]]:
  """The dimensions of the arrays of an instruction's result (a tuple's each), leading 1s
  dropped (a stage's slice of a stage-batched array is [1, ...])."""
  return [_without_leading_ones(dims) for _, dims in ins.arrays()]


def loop_sends(hlo: str, trip_count: int, dims: tuple[int, ...]) -> list[int]:
  """For each while loop of the entry computation with `trip_count` iterations (a pipeline's
  forward and backward tick loops; loops inside them, such as a layer's, may have as many),
  how many collectives between devices its body runs per iteration that move an array
  of dimensions `dims` (one device's rows of one microbatch: rows, Q, D; leading 1s dropped
  as array_dims drops them). Loops nested in the body (a stage's layer scan) are not looked
  into; all-to-alls (the MoE exchange) are not counted."""
  module, dims = parse(hlo), _without_leading_ones(dims)
  return [_sends(module, ins.attr("body"), dims, set())
          for ins in module.computations[module.entry]
          if ins.opcode == "while" and ins.trip_count() == trip_count]


def _sends(module: Module, name: str, dims: tuple[int, ...], seen: set) -> int:
  if name in seen or name not in module.computations:
    return 0
  seen.add(name)
  total = 0
  for ins in module.computations[name]:
    if ins.opcode == "while":
      continue
    if (ins.opcode.startswith(STAGE_COLLECTIVES) and not ins.opcode.endswith("-done") and
        dims in array_dims(ins) and read.group_size(ins.line) > 1):
      total += 1
    total += sum(_sends(module, c, dims, seen) for c in ins.callees)
  return total


def collective_calls(hlo: str) -> dict[str, int]:
  """{kind: calls per run of the entry computation} of the collectives between devices that
  `moejax.aot.read.collectives` finds (each once per iteration of the loops around it), groups
  of one device left out; a collective whose groups are not spelled out fails the test
  (read.group_size raises) rather than count as one device's."""
  module = parse(hlo)
  comps = {name: module.by_name(name) for name in module.computations}
  calls: dict[str, int] = {}
  for c in read.collectives(module):
    if read.group_size(comps[c.computation][c.name].line) > 1:
      calls[c.kind] = calls.get(c.kind, 0) + c.runs
  return calls
