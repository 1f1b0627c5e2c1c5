"""What every study does the same way: how a runnable starts (`start`: the fake devices, the
commit), how results are written (stamped with the metadata that says what ran where:
`metadata()`), the default run's config and cost model, how a lowered module's operations are
walked. `python -m benchmarks.common stamp FILE --command CMD` stamps a result that a tool
outside benchmarks/ wrote (e.g. `moejax.replay --json`). Importing it runs nothing: no git, no
JAX, no environment change."""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)


def start() -> None:
  """What a runnable study does first, in its `if __name__ == "__main__":` block. Fakes 8 host
  CPU devices unless the caller set XLA_FLAGS, so that every study sees the mesh the tests use:
  JAX reads the flag when it starts its backends (the first device query, not `import jax`), so
  this runs before `main`, and nothing a study does at import may start them (the studies' test
  checks). On a GPU machine the flag only affects the host platform. Then notes the commit the
  run started from: the code it imported, not whatever is checked out when a long run ends."""
  global _started_at
  if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  _started_at = commit()


def default_config(bindings: list[str] | None = None):
  """The config `python train.py` runs (configs/default.gin), with `bindings` on top."""
  from moejax.frontend import DEFAULT_GIN, parse_config
  return parse_config([DEFAULT_GIN], list(bindings or []))


@functools.cache
def default_cost():
  """The placement cost model of the default run: its model on its hardware profile."""
  from moejax.strategy.placement_cost import of_config
  return of_config(default_config())


def command(name: str, argv: list[str] | None = None) -> str:
  """The command line that reruns benchmark `name` with `argv` (default: this process's)."""
  return shlex.join(["python", "-m", f"benchmarks.{name}",
                     *(sys.argv[1:] if argv is None else argv)])


# The fields every committed result carries under "metadata" (tests/test_results_render.py).
METADATA_FIELDS = ("command", "commit", "date", "machine", "load")


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str:
  """HEAD's short hash, with `-dirty` when tracked code outside the studies' results/
  differs."""
  head = _git("rev-parse", "--short=12", "HEAD")
  if head is None:
    return "unknown (not run from a git checkout)"
  dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
               ":(exclude,glob)benchmarks/*/results/**")
  return head + ("-dirty" if dirty else "")


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict:
  """The devices the run used (from JAX when this process imported it), the host CPU and the
  jax version."""
  try:
    jax_version = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    jax_version = "not installed"
  device = "host CPU only (JAX not used)"
  if "jax" in sys.modules:
    devices = sys.modules["jax"].devices()
    kind = devices[0].device_kind
    device = (f"{len(devices)} fake CPU devices" if devices[0].platform == "cpu"
              else f"{len(devices)} x {kind}")
  return {"device": device, "host": f"{cpu_model()}, {os.cpu_count()} cores",
          "jax": jax_version}


def load() -> dict:
  """The host's 1, 5 and 15-minute load averages now: how shared the machine was."""
  one, five, fifteen = os.getloadavg()
  return {"1min": round(one, 2), "5min": round(five, 2), "15min": round(fifteen, 2),
          "cores": os.cpu_count()}


# The commit `start` noted; None in a process that did not start as a study (a test, a tool).
_started_at: str | None = None


def metadata(cmd: str) -> dict:
  """command, commit (the one the run started from, else HEAD now), date, machine and load of
  a result written now by `cmd`."""
  now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
  return {"command": cmd, "commit": _started_at or commit(), "date": now.isoformat(),
          "machine": machine(), "load": load()}


def stamp(result: dict, cmd: str | None = None) -> dict:
  """Puts `metadata(cmd)` into result["metadata"], keeping the keys a benchmark put there
  itself. The command is `cmd`, else the result's own "command" (top level, moved into
  metadata, or already in metadata)."""
  meta = result.setdefault("metadata", {})
  cmd = cmd or result.pop("command", None) or meta.get("command")
  if not cmd:
    raise ValueError("a result needs the command that reran it: pass cmd= or set "
                     "result['command'] (benchmarks.common.command builds it)")
  meta.update(metadata(cmd))
  return result


def write_result(result: dict, path: str, *, restamp: bool = True) -> None:
  """Stamps `result` (`stamp`; restamp=False keeps the metadata of a result rewritten in
  place, e.g. a refit of stored timings) and writes it as indented JSON to `path` (folders
  made), and says where."""
  if restamp:
    stamp(result)
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


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.common")
  sub = ap.add_subparsers(dest="what", required=True)
  st = sub.add_parser("stamp", help="stamp a result JSON written by a tool outside benchmarks/")
  st.add_argument("path")
  st.add_argument("--command", required=True, help="the command line that wrote it")
  args = ap.parse_args(argv)
  with open(args.path) as f:
    result = json.load(f)
  write_result(stamp(result, args.command), args.path, restamp=False)


if __name__ == "__main__":
  main()
