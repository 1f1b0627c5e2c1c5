"""What every benchmark does the same way: where results go, how they are written, how a
lowered module's operations are walked."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

import jax

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def command(name: str, argv: list[str] | None = None) -> str:
  """The command line that reruns benchmark `name` with `argv` (default: this process's)."""
  return shlex.join(["python", "-m", f"benchmarks.{name}",
                     *(sys.argv[1:] if argv is None else argv)])


def _head() -> str:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


_COMMIT = _head()       # the code a run imported, not whatever is checked out when it ends


def provenance() -> dict:
  """Where a result comes from: the commit its code was imported from, the date (UTC), the
  machine (CPU model or GPU kind, jax version) and the 1-minute load average when written."""
  commit = _COMMIT
  kinds = sorted({d.device_kind for d in jax.devices()})
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
  except OSError:
    pass
  return {"commit": commit, "date": datetime.datetime.now(datetime.UTC).isoformat(),
          "machine": {"cpu": cpu, "cores": os.cpu_count(), "devices": kinds,
                      "jax": jax.__version__},
          "load": os.getloadavg()[0]}


def write_result(result: dict, path: str) -> None:
  """Writes `result` as indented JSON to `path` (folders made), with its `provenance` where
  the result does not say it itself, and says where."""
  result = {**provenance(), **result}
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
