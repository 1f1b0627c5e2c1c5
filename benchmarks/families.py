"""How each family of result files reads as a table: a family is a file-name prefix and one
function registered with `@family(prefix, title)` that takes the family's files ({name: JSON})
and returns a `Section` (markdown lines, and rows for the README's headline table). Each study
folder's `tables.py` registers the families of the results beside it; `python -m
benchmarks.render` imports them all and orders the sections. Plain JSON and strings, no JAX."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class Section:
  lines: list[str]
  # README rows: (what, result, file); the machine column comes from the file's metadata.
  headline: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Family:
  prefix: str
  title: str
  render: Callable[[dict[str, dict]], Section]


FAMILIES: list[Family] = []


def family(prefix: str, title: str):
  """Registers a renderer for the result files whose names start with `prefix` (the longest
  matching prefix wins)."""
  def register(fn):
    FAMILIES.append(Family(prefix, title, fn))
    return fn
  return register


def table(header: list[str], rows: list[list]) -> list[str]:
  out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return out


def num(x, digits: int = 3) -> str:
  if x is None:
    return ""
  return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def pct(x, digits: int = 2) -> str:
  return "" if x is None else f"{100 * x:.{digits}f}%"


def ratio(x) -> str:
  return f"{x:.2f}x"
