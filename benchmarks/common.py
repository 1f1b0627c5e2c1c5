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


def cpu_model() -> str:
  """The host CPU's model name (Linux /proc/cpuinfo), or the platform's processor."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  import platform
  return platform.processor() or platform.machine()


def provenance(name: str, argv: list[str] | None = None, device: str | None = None) -> dict:
  """`command`, `commit`, `date`, `machine` (CPU model or `device`, jax version) and `load`
  (the 1-minute load average now) of a benchmark result."""
  import datetime
  import subprocess

  import jax

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                            text=True, timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    commit = None
  return {"command": command(name, argv), "commit": commit,
          "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "machine": f"{device or cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__}",
          "load": os.getloadavg()[0]}
