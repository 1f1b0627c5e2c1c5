"""Reading XLA's optimised HLO text: computations, instructions, operands, and what a
computation calls; for the tests that check which collectives wait for which matmuls."""

from __future__ import annotations

import re

# Computations an instruction runs: fusions, reductions, loop bodies and conditions.
CALLS = r"(?:calls|to_apply|body|condition)=%([\w.\-]+)"


def callees(line: str) -> list[str]:
  """The computations an instruction runs, conditional branches included."""
  names = re.findall(CALLS, line)
  for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
    names += re.findall(r"%([\w.\-]+)", group)
  return names


def computations(hlo: str) -> dict[str, dict[str, str]]:
  """{computation name: {instruction name: its line}} of an HLO module's text."""
  comps, current = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):
      current = comps.setdefault(re.search(r"%?([\w.\-]+) \(", line).group(1), {})
    elif current is not None and (m := re.match(r"\s+(?:ROOT )?%([\w.\-]+) = ", line)):
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
      return re.findall(r"%([\w.\-]+)", args[:end])
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
