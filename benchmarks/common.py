"""What every benchmark does the same way: where results go, how they are written, how a
lowered module's operations are walked."""

from __future__ import annotations

import json
import os
import shlex
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def command(name: str, argv: list[str] | None = None) -> str:
  """The command line that reruns benchmark `name` with `argv` (default: this process's)."""
  return shlex.join(["python", "-m", f"benchmarks.{name}",
                     *(sys.argv[1:] if argv is None else argv)])


def write_result(result: dict, path: str) -> None:
  """Writes `result` as indented JSON to `path` (folders made) and says where."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {path}")


def ir_operations(module):
  """Every operation of an MLIR module (a lowered program's StableHLO), nested ones included,
  in program order."""
  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          yield inner.operation
          yield from walk(inner.operation)

  return walk(module.operation)


def provenance() -> dict:
  """commit, date, machine (CPU model, jax version) and load (1-minute average) of this run."""
  import datetime
  import platform
  import subprocess

  import jax

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip() or None
  cpu = platform.processor() or None
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                 cpu)
  return {"commit": commit, "date": datetime.datetime.now(datetime.UTC).isoformat(
      timespec="seconds"), "machine": {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
                                       "python": platform.python_version()},
          "load": os.getloadavg()[0]}
