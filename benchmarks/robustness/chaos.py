"""Kill soak: the default job, shortened, killed again and again, ends bit-identical.

`python -m benchmarks.robustness.chaos --kills 10 [--sigterm 3]` trains the default job
(configs/default.gin, `--steps` steps, a checkpoint every `--every`, SmartMoE re-placing every
`--replan`) once without interruption, then once more while killing it (`kill -9`) `--kills`
times and stopping it (SIGTERM) `--sigterm` times, each time running the same command again.
Kills land at random steps, while a checkpoint is being written (the checkpoint's unfinished
directory is seen, and is still there after the kill), and inside a layout migration (the child
process pauses `--hold` seconds inside the migration call and says so with a marker file; the
pause changes no number). At the end the final checkpoint's content digest and every metrics
record (timings left out) must equal the uninterrupted run's, bit for bit. Prints a table and
writes `benchmarks/robustness/results/chaos_cpu.json`: kills survived, steps recomputed, seconds
lost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import command, start, write_result
from benchmarks.robustness import RESULTS

TIMINGS = ("tokens_per_s", "planning_s", "migration_s", "seconds")   # differ between any two runs
CHAOS_EVENTS = ("run_dir_warning", "checkpoint_warning", "preempted")   # only a killed run has


def child(marker: str, hold: float, flags: list[str]) -> int:
  """train.py's main, with a pause inside every layout migration (after the move is
  dispatched, before the trainer adopts it) that a marker file announces."""
  sys.path.insert(0, os.getcwd())
  import train as train_cli
  from moejax.train import controllers

  real = controllers.migrate

  def held(*args, **kwargs):
    out = real(*args, **kwargs)
    with open(marker, "w"):
      pass
    time.sleep(hold)
    os.unlink(marker)
    return out

  controllers.migrate = held
  return train_cli.main(flags)


class Run:
  """One run dir and the `python -m benchmarks.robustness.chaos --child` processes that train
  in it."""

  def __init__(self, work: str, name: str, args: argparse.Namespace):
    self.dir = os.path.join(work, name)
    self.marker = os.path.join(work, f"{name}.migrating")
    self.log = os.path.join(work, f"{name}.log")
    bindings = (f"train.run_dir = '{self.dir}'", f"train.num_steps = {args.steps}",
                f"checkpoint.every = {args.every}", f"planner.every = {args.replan}",
                f"train.eval_every = {args.steps // 2}", "train.progress_bar = False",
                *args.gin_bindings)
    self.command = [sys.executable, "-m", "benchmarks.robustness.chaos", "--child", self.marker,
                    "--hold", str(args.hold), "--", *(f"--gin_bindings={b}" for b in bindings)]
    self.proc: subprocess.Popen | None = None

  def start(self) -> None:
    if os.path.exists(self.marker):
      os.unlink(self.marker)
    with open(self.log, "a") as log:
      self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)

  def wait(self) -> int:
    return self.proc.wait(timeout=1800)

  def complete_checkpoints(self) -> list[int]:
    path = os.path.join(self.dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []

  def saving(self) -> bool:
    path = os.path.join(self.dir, "checkpoints")
    return os.path.isdir(path) and any("tmp" in n for n in os.listdir(path))

  def records(self) -> list[dict]:
    path = os.path.join(self.dir, "metrics.jsonl")
    if not os.path.exists(path):
      return []
    out = []
    with open(path) as f:
      for line in f:
        try:
          out.append(json.loads(line))
        except ValueError:
          pass   # a line being written
    return out

  def metrics_inode(self) -> int | None:
    path = os.path.join(self.dir, "metrics.jsonl")
    return os.stat(path).st_ino if os.path.exists(path) else None

  def last_step(self) -> int:
    return max([r["step"] for r in self.records() if "loss" in r], default=-1)

  def digest(self, step: int) -> dict:
    with open(os.path.join(self.dir, "checkpoints", str(step), "meta", "metadata")) as f:
      return json.load(f)["digest"]


def comparable(records: list[dict]) -> list[dict]:
  return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records
          if r.get("event") not in CHAOS_EVENTS]


def wait_for(run: Run, kind: str, target_step: int, rng: np.random.Generator) -> bool:
  """Polls until the moment to stop `run`'s process; False if it finished first."""
  while run.proc.poll() is None:
    if kind == "save" and run.saving():
      return True
    if kind == "migration" and os.path.exists(run.marker):
      return True
    if kind in ("random", "sigterm") and run.last_step() >= target_step:
      time.sleep(float(rng.uniform(0.0, 0.3)))   # anywhere in the step, or between steps
      return run.proc.poll() is None
    time.sleep(0.001 if kind in ("save", "migration") else 0.02)
  return False


def schedule(args: argparse.Namespace, rng: np.random.Generator) -> list[str]:
  """Migration kills first (a migration must still lie ahead), the rest shuffled."""
  rest = (["save"] * args.saves + ["random"] * (args.kills - args.saves - args.migrations) +
          ["sigterm"] * args.sigterm)
  rng.shuffle(rest)
  return ["migration"] * args.migrations + rest


def soak(run: Run, args: argparse.Namespace, rng: np.random.Generator) -> list[dict]:
  kinds, events = schedule(args, rng), []
  run.start()
  tick = time.perf_counter()
  while kinds:
    kind = kinds.pop(0)
    resumed_from = (run.complete_checkpoints() or [0])[-1]
    target = min(resumed_from + int(rng.integers(3, 2 * args.every)), args.steps - 2)
    if not wait_for(run, kind, target, rng):
      break
    sig = signal.SIGTERM if kind == "sigterm" else signal.SIGKILL
    run.proc.send_signal(sig)
    rc = run.wait()
    at = run.last_step()
    interrupted_save = run.saving()
    if kind == "save" and not interrupted_save and "random" in kinds:
      kinds[kinds.index("random")] = "save"   # the save finished first: try another
    restart, stale = time.perf_counter(), run.metrics_inode()
    run.start()
    next_from = (run.complete_checkpoints() or [0])[-1]
    # The resumed run first rewrites metrics.jsonl into a new file (a new inode).
    while (run.metrics_inode() in (None, stale) or run.last_step() < next_from) and (
        run.proc.poll() is None):
      time.sleep(0.05)
    events.append({"kind": kind, "signal": signal.Signals(sig).name, "exit_code": rc,
                   "last_step_logged": at, "resumed_from": next_from,
                   "steps_recomputed": max(0, at + 1 - next_from),
                   "interrupted_a_save": interrupted_save,
                   "seconds_to_first_new_step": round(time.perf_counter() - restart, 2),
                   "at_s": round(restart - tick, 2)})
    print(f"{len(events):3d} {kind:<9} {events[-1]['signal']:<8} at step {at:4d} -> resumed "
          f"from {next_from:4d} (recomputes {events[-1]['steps_recomputed']}), "
          f"save interrupted: {interrupted_save}", flush=True)
  assert run.wait() == 0, open(run.log).read()[-3000:]
  return events


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--child"]:
    split = argv.index("--")
    return child(argv[1], float(argv[argv.index("--hold") + 1]), argv[split + 1:])
  parser = argparse.ArgumentParser(prog="python -m benchmarks.robustness.chaos",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--kills", type=int, default=10, help="kill -9s")
  parser.add_argument("--sigterm", type=int, default=0, help="SIGTERM stops, besides")
  parser.add_argument("--saves", type=int, default=2, help="kills aimed at a checkpoint write")
  parser.add_argument("--migrations", type=int, default=1, help="kills inside a migration")
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--every", type=int, default=20, help="checkpoint.every")
  parser.add_argument("--replan", type=int, default=25, help="planner.every")
  parser.add_argument("--hold", type=float, default=0.5,
                      help="seconds the child pauses inside each migration")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="more bindings for both runs, e.g. a smaller model")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--work", default=None, help="work dir (default: a temporary one)")
  parser.add_argument("--out", default=os.path.join(RESULTS, "chaos_cpu.json"))
  args = parser.parse_args(argv)
  if args.kills < args.saves + args.migrations:
    parser.error(f"--kills={args.kills} must be >= --saves + --migrations "
                 f"({args.saves + args.migrations})")
  work = args.work or tempfile.mkdtemp(prefix="moejax_chaos_")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(work, "jax_cache"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  rng = np.random.default_rng(args.seed)
  reference, chaos = Run(work, "reference", args), Run(work, "chaos", args)
  tick = time.perf_counter()
  reference.start()   # also fills the compilation cache both runs share
  assert reference.wait() == 0, open(reference.log).read()[-3000:]
  reference_s = time.perf_counter() - tick
  print(f"uninterrupted: {args.steps} steps in {reference_s:.1f} s", flush=True)
  tick = time.perf_counter()
  events = soak(chaos, args, rng)
  chaos_s = time.perf_counter() - tick

  same_digest = reference.digest(args.steps) == chaos.digest(args.steps)
  ref_records, chaos_records = comparable(reference.records()), comparable(chaos.records())
  same_metrics = ref_records == chaos_records
  steps = [r["step"] for r in chaos.records() if "loss" in r]
  kills = [e for e in events if e["signal"] == "SIGKILL"]
  summary = {
      "kills_survived": len(kills), "sigterm_stops": len(events) - len(kills),
      "kills_during_a_save": sum(e["kind"] == "save" and e["interrupted_a_save"] for e in kills),
      "kills_inside_a_migration": sum(e["kind"] == "migration" for e in kills),
      "steps_recomputed": sum(e["steps_recomputed"] for e in events),
      "seconds_lost": round(chaos_s - reference_s, 1),
      "final_digest_identical": same_digest, "metrics_identical": same_metrics,
      "every_step_once": steps == list(range(args.steps)),
      "layout_switches": sum(r.get("event") == "layout_switch" for r in ref_records)}
  print("\n".join(f"{k:<26} {v}" for k, v in summary.items()))
  result = {"command": command("robustness.chaos", argv), "machine": platform.platform(),
            "cpu_count": os.cpu_count(), "jax": _jax_version(),
            "job": {"config": "configs/default.gin", "num_steps": args.steps,
                    "checkpoint.every": args.every, "planner.every": args.replan,
                    "gin_bindings": args.gin_bindings,
                    "seed": args.seed, "migration_hold_s": args.hold},
            "reference_s": round(reference_s, 1), "chaos_s": round(chaos_s, 1),
            "summary": summary, "events": events,
            "note": "the uninterrupted run went first and filled the compilation cache both "
                    "share; seconds lost = chaos wall time - uninterrupted wall time, on a "
                    "machine shared with other work"}
  write_result(result, args.out)
  if not args.work:
    shutil.rmtree(work, ignore_errors=True)
  return 0 if same_digest and same_metrics and summary["every_step_once"] else 1


def _jax_version() -> str:
  out = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__)"],
                       capture_output=True, text=True)
  return out.stdout.strip()


if __name__ == "__main__":
  start()
  raise SystemExit(main())
