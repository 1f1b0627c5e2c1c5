"""What XLA:GPU holds at a compiled program's memory peak, read from its dump: compile with
`dump_flags(DIR)` added to the flags, then `peak_buffers(DIR)` lists every buffer live at
the peak XLA's live-range analysis finds (the dump's `*-live-range.txt`), largest first,
with its shape and op name from the dump's scheduled HLO. The memory model's terms
(moejax.strategy.memory) were read this way (decision 0099). `memory_analysis()`'s temp is
the size of XLA's heap, which can exceed what is live at the peak (its packing).

  python -m moejax.aot.peak_buffers DIR [--top 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re

from moejax.aot.hlo import op_name


@dataclasses.dataclass(frozen=True)
class Buffer:
  name: str          # the instruction, with its tuple index in braces
  bytes: int
  shape: str         # the instruction's (a tuple's whole shape for one of its elements)
  op_name: str


def dump_flags(directory: str) -> tuple[str, ...]:
  """XLA flags (as `compile_train_step(flags=...)` takes them) that dump the train step's
  scheduled HLO, buffer assignment and live ranges into `directory`."""
  return (f"--xla_dump_to={directory}", "--xla_dump_hlo_as_text=true",
          "--xla_dump_hlo_module_re=.*train_step.*")


def _one(directory: str, suffix: str) -> str:
  found = glob.glob(os.path.join(directory, f"*after_optimizations{suffix}"))
  if len(found) != 1:
    raise FileNotFoundError(f"{directory}: expected one *after_optimizations{suffix} of an "
                            f"XLA dump, found {len(found)}; compile with dump_flags(DIR).")
  with open(found[0]) as f:
    return f.read()


def peak_buffers(directory: str) -> list[Buffer]:
  """The buffers live at the program's peak, largest first (arguments included)."""
  live = _one(directory, "-live-range.txt")
  start = live.index("(peak):")
  end = live.find("Stack trace", start)
  block = live[start:end if end > 0 else None]
  info = {}
  for line in _one(directory, ".txt").splitlines():
    m = re.match(r"\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ", line)
    if m:
      info.setdefault(m.group(1), (m.group(2), op_name(line)))
  found = []
  for name, index, size in re.findall(r"^\s+(\S+?)(\{[\d,]*\}): (\d+) bytes", block, re.M):
    shape, op = info.get(name, ("", ""))
    if shape.startswith("(") and index != "{}":      # one element of a tuple
      elements = _elements(shape)
      at = int(index[1:-1].split(",")[0])
      shape = elements[at] if at < len(elements) else shape
    found.append(Buffer(name + index, int(size), shape, op))
  return sorted(found, key=lambda b: -b.bytes)


def _elements(tuple_shape: str) -> list[str]:
  """The element shapes of an HLO tuple shape, `(s32[], f32[6,8]{1,0}, ...)`."""
  body = re.sub(r"/\*.*?\*/", "", tuple_shape)[1:-1]
  parts, depth, current = [], 0, ""
  for ch in body:
    if ch in "[{(":
      depth += 1
    elif ch in "]})":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append(current.strip())
      current = ""
    else:
      current += ch
  return parts + [current.strip()]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("directory")
  parser.add_argument("--top", type=int, default=40)
  args = parser.parse_args(argv)
  buffers = peak_buffers(args.directory)
  print(f"{sum(b.bytes for b in buffers) / 1e9:.3f} GB live at the peak, "
        f"{len(buffers)} buffers; the largest:")
  for b in buffers[:args.top]:
    print(f"{b.bytes / 2**20:9.1f} MiB  {b.name:<32} {b.shape[:40]:<40} {b.op_name[-90:]}")


if __name__ == "__main__":
  main()
