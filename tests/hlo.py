"""Reading XLA's optimised HLO text: computations, instructions, operands, and what a
computation calls; for the tests that check which collectives wait for which matmuls and how
many messages a pipeline's tick loops send."""

from __future__ import annotations

import re

from moejax.aot.read import group_size

# Computations an instruction runs: fusions, reductions, loop bodies and conditions.
CALLS = r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)"


def callees(line: str) -> list[str]:
  """The computations an instruction runs, conditional branches included."""
  names = re.findall(CALLS, line)
  for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
    names += re.findall(r"%?([\w.\-]+)", group)
  return names


def computations(hlo: str) -> dict[str, dict[str, str]]:
  """{computation name: {instruction name: its line}} of an HLO module's text: optimised, or
  as lowered (`as_text(dialect="hlo", debug_info=True)`: names without %, no signatures)."""
  comps, current = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):
      current = comps.setdefault(re.search(r"%?([\w.\-]+) [({]", line).group(1), {})
    elif current is not None and (m := re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = ", line)):
      current[m.group(1)] = line
  return comps


def opcode(line: str) -> str:
  rhs = line.split(" = ", 1)[1]
  if rhs.startswith("("):                   # a tuple shape: skip its balanced parentheses
    depth = 0
    for i, c in enumerate(rhs):
      depth += {"(": 1, ")": -1}.get(c, 0)
      if depth == 0:
        rhs = rhs[i + 1:]
        break
  return re.match(r"\s*(?:\S+\s+)?([\w\-]+)\(", rhs).group(1)


def operands(line: str) -> list[str]:
  args = line.split(" = ", 1)[1]
  args = args[args.index(opcode(line) + "(") + len(opcode(line)) + 1:]
  depth = 1
  for end, c in enumerate(args):
    depth += {"(": 1, ")": -1}.get(c, 0)
    if depth == 0:
      if "%" in args[:end]:
        return re.findall(r"%([\w.\-]+)", args[:end])
      return [a.strip() for a in args[:end].split(",") if a.strip()]    # as lowered
  raise ValueError(f"unbalanced operands: {line}")


def has_dot(comps, name: str, seen=None) -> bool:
  """Whether computation `name` (or one it calls) contains a dot or convolution."""
  seen = set() if seen is None else seen
  if name in seen or name not in comps:
    return False
  seen.add(name)
  for line in comps[name].values():
    if opcode(line) in ("dot", "convolution"):
      return True
    if any(has_dot(comps, c, seen) for c in callees(line)):
      return True
  return False


def depends_on(comp: dict[str, str], name: str, pred) -> str | None:
  """The first instruction of `comp` that `name` depends on through its operands (transitively)
  and that satisfies `pred(line)`, or None."""
  stack, seen = list(operands(comp[name])), set()
  while stack:
    op = stack.pop()
    if op in seen or op not in comp:
      continue
    seen.add(op)
    if pred(comp[op]):
      return comp[op]
    stack.extend(operands(comp[op]))
  return None


def array_dims(line: str) -> list[tuple[int, ...]]:
  """The dimensions of the arrays of an instruction's result (a tuple's each), leading 1s
  dropped (a stage's slice of a stage-batched array is [1, ...])."""
  shape = line.split(" = ", 1)[1].split(opcode(line) + "(", 1)[0]
  out = []
  for dims in re.findall(r"[a-z]\w*\[([\d,]*)\]", shape):
    d = [int(x) for x in dims.split(",") if x]
    while d and d[0] == 1:
      d = d[1:]
    out.append(tuple(d))
  return out


STAGE_COLLECTIVES = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter")


def loop_sends(hlo: str, trip_count: int, dims: tuple[int, ...]) -> list[int]:
  """For each while loop of the entry computation with `trip_count` iterations (a pipeline's
  forward and backward tick loops; loops inside them, such as a layer's, may have as many),
  how many collectives between devices its body runs per iteration that move an array
  of dimensions `dims` (one device's rows of one microbatch: rows, Q, D; leading 1s dropped
  as array_dims drops them). Loops nested in the body (a stage's layer scan) are not looked
  into; all-to-alls (the MoE exchange) are not counted."""
  comps = computations(hlo)
  dims = tuple(dims)
  while dims and dims[0] == 1:
    dims = dims[1:]
  counts = []
  for line in comps[entry(hlo)].values():
    trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
    if opcode(line) != "while" or trip is None or int(trip.group(1)) != trip_count:
      continue
    body = re.search(r"body=%([\w.\-]+)", line).group(1)
    counts.append(_sends(comps, body, dims, set()))
  return counts


def entry(hlo: str) -> str:
  """The name of the module's entry computation."""
  return re.search(r"\nENTRY %([\w.\-]+)", hlo).group(1)


def _sends(comps, name: str, dims: tuple[int, ...], seen: set) -> int:
  if name in seen or name not in comps:
    return 0
  seen.add(name)
  total = 0
  for line in comps[name].values():
    op = opcode(line)
    if op == "while":
      continue
    if (op.startswith(STAGE_COLLECTIVES) and not op.endswith("-done") and
        dims in array_dims(line) and group_size(line) > 1):
      total += 1
    total += sum(_sends(comps, c, dims, seen) for c in callees(line))
  return total


def collective_calls(hlo: str) -> dict[str, int]:
  """{opcode: calls per run of the entry computation} of the collectives between devices
  (groups of one device left out): each instruction counted once per iteration of the while
  loops around it (their known trip counts)."""
  comps = computations(hlo)
  runs: dict[str, int] = {}

  def walk(name, times):
    if name not in comps or runs.get(name, 0) >= times:
      return
    runs[name] = times
    for line in comps[name].values():
      trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
      inner = times * (int(trip.group(1)) if opcode(line) == "while" and trip else 1)
      for callee in callees(line):
        walk(callee, inner)

  walk(entry(hlo), 1)
  calls: dict[str, int] = {}
  for name, comp in comps.items():
    for line in comp.values():
      op = opcode(line)
      if (op.startswith(STAGE_COLLECTIVES + ("all-to-all",)) and not op.endswith("-done") and
          group_size(line) > 1):
        key = op.removesuffix("-start")
        calls[key] = calls.get(key, 0) + runs.get(name, 0)
  return calls
