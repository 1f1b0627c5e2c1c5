"""What re-planning every step costs the default job: step time with `planner.every = 1`
against `planner.every = 1000`.

The default job (configs/default.gin: SmartMoE placement, ep, capacity pooled per device, 8
fake CPU devices) runs `--steps` steps through the trainer (`moejax.train.trainer.Trainer`, as
train.py builds it; only the run dir, the step count and the progress bar are bound besides the
variant's planner knobs) once per variant per repeat, the variants interleaved in rotating
order:

  every1000        planner.every = 1000: only the cold-start re-plan (step 2)
  every1_lag1      planner.every = 1, planner.lag = 1: planned on a thread while a step trains
  every1_lag0      planner.every = 1, planner.lag = 0: planned on the loop's thread (contrast)
  every1_lag1_nothread  as every1_lag1, planned on the loop's thread (the same layouts; only
                   with --variants, against --base every1_lag1: the thread's own price)

A step's time is the wall time from one `before_step` to the next (a hook that runs before the
controllers): it holds that step's re-plan wait and weight migration, its dispatch and the read
of the previous step's metrics. The first `--warmup` steps are left out (the first migration
compiles the slot permutation). Per run: the median and mean step time, the re-plans and their
planning time (on whichever thread planned), the loop's wait for the planning thread, the
migrations (ep moves the moved experts' weights and Adam moments) and their time, the timed
steps' share spent migrating and planning on the loop's thread (or waiting for the planning
thread): the host-side price read from counters, steadier than a ratio of step times on a
shared machine; and the
balance line train.py ends with (dropped share of choices over the run's second half against
the static layout's). Ratios against every1000 are taken within each repeat, then the median
over repeats is reported. The 8 devices share the host's cores, so the host load (recorded
before and after each run) moves the numbers: read the ratios, not the seconds.

  python -m benchmarks.placement.replan_overhead [--steps 40] [--repeats 3]
  python -m benchmarks.placement.replan_overhead --variants every1_lag1 every1_lag1_nothread \
      --base every1_lag1_nothread \
      --json benchmarks/placement/results/replan_overhead_cpu_thread.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import command, default_config, load, start, write_result
from benchmarks.placement import RESULTS

VARIANTS = {"every1000": {"planner.every": 1000},
            "every1_lag1": {"planner.every": 1, "planner.lag": 1},
            "every1_lag0": {"planner.every": 1, "planner.lag": 0},
            # The same layouts as every1_lag1, planned on the loop's thread: the thread's own
            # price, apart from the lag's other layouts (not a config: the tests' reference).
            "every1_lag1_nothread": {"planner.every": 1, "planner.lag": 1}}
NO_THREAD = ("every1_lag1_nothread",)
DEFAULT_JSON = os.path.join(RESULTS, "replan_overhead_cpu.json")


def parse_args(argv):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.placement.replan_overhead",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=40, help="steps per run")
  ap.add_argument("--warmup", type=int, default=6, help="first steps left out of the timing")
  ap.add_argument("--repeats", type=int, default=3, help="runs of every variant")
  ap.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v not in NO_THREAD],
                  choices=list(VARIANTS))
  ap.add_argument("--base", default="every1000", choices=list(VARIANTS),
                  help="the variant the ratios are taken against")
  ap.add_argument("--json", default=DEFAULT_JSON)
  return ap.parse_args(argv)


def one_run(variant: str, args, work: str) -> dict:
  from moejax.train.controllers import Hook
  from moejax.train.trainer import Trainer

  class StepClock(Hook):
    """Before the controllers: the time, and the re-planner's totals so far, at each step."""
    def __init__(self):
      self.ticks: list[float] = []
      self.totals: list[tuple[float, float, float]] = []

    def before_step(self, trainer, step):
      self.ticks.append(time.perf_counter())
      r = trainer.layouts
      on_loop = r.ahead.lag == 0 or not r.ahead.threaded
      self.totals.append((r.migration_s, r.planning_s if on_loop else r.waited_s,
                          r.migrations))
      return False

  run_dir = tempfile.mkdtemp(prefix=f"{variant}_", dir=work)
  bindings = [f"train.num_steps = {args.steps}", f"train.run_dir = '{run_dir}'",
              "train.progress_bar = False",
              *(f"{k} = {v}" for k, v in VARIANTS[variant].items())]
  cfg = default_config(bindings)
  clock, before = StepClock(), load()
  with Trainer(cfg) as trainer:
    trainer.layouts.ahead.threaded = variant not in NO_THREAD
    out = trainer.run(hooks=[clock])
    layouts = trainer.layouts
  steps_s = [b - a for a, b in zip(clock.ticks, clock.ticks[1:])][args.warmup:]
  # The timed steps' share spent migrating, and planning on the loop's thread (lag 0) or
  # waiting for the planning thread (lag >= 1): the host's part of the price, from counters.
  (m0, p0, n0), (m1, p1, n1) = clock.totals[args.warmup], clock.totals[-1]
  window_s = clock.ticks[-1] - clock.ticks[args.warmup]
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  switches = [r for r in records if r.get("event") == "layout_switch"]
  balance = out["balance"] or {}
  return {"variant": variant, "bindings": bindings, "steps_timed": len(steps_s),
          "median_step_s": statistics.median(steps_s), "mean_step_s": statistics.fmean(steps_s),
          "plans": layouts.plans, "planning_s": layouts.planning_s,
          "planning_ms_per_plan": 1e3 * layouts.planning_s / max(layouts.plans, 1),
          "waited_s": layouts.waited_s, "migrations": layouts.migrations,
          "migration_s": layouts.migration_s,
          "migration_ms_each": 1e3 * layouts.migration_s / max(layouts.migrations, 1),
          "timed_migrations": n1 - n0, "timed_migration_share": (m1 - m0) / window_s,
          "timed_loop_planning_share": (p1 - p0) / window_s,
          "layer_switches": len(switches), "final_loss": out["last"]["loss"],
          "dropped_fraction": balance.get("dropped_fraction"),
          "static_dropped_fraction": balance.get("static_dropped_fraction"),
          "load_before": before, "load_after": load()}


def ratios(rows: list[dict], variants: list[str], repeats: int, base: str) -> dict:
  """{variant: {median_step, mean_step: {median, per_repeat}}} over the base variant."""
  out = {}
  for v in variants:
    if v == base:
      continue
    out[v] = {}
    for key in ("median_step_s", "mean_step_s"):
      per = [next(r for r in rows if r["variant"] == v and r["repeat"] == i)[key] /
             next(r for r in rows if r["variant"] == base and r["repeat"] == i)[key]
             for i in range(repeats)]
      out[v][key.removesuffix("_s")] = {"median": statistics.median(per), "per_repeat": per}
  return out


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.base not in args.variants:
    raise SystemExit(f"--variants must include --base {args.base}: the ratios are taken "
                     "against it")
  import jax  # the package's __init__ has set 8 fake devices
  rows = []
  with tempfile.TemporaryDirectory(prefix="replan_overhead_") as work:
    # Every run compiles the same programs: the cache keeps that out of the benchmark's time.
    jax.config.update("jax_compilation_cache_dir", os.path.join(work, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    for i in range(args.repeats):
      order = args.variants[i % len(args.variants):] + args.variants[:i % len(args.variants)]
      for v in order:
        row = {**one_run(v, args, work), "repeat": i}
        rows.append(row)
        print(f"repeat {i} {v:<12} median {row['median_step_s']:.3f} s  mean "
              f"{row['mean_step_s']:.3f} s  plans {row['plans']} "
              f"({row['planning_ms_per_plan']:.2f} ms each, waited {row['waited_s']:.3f} s)  "
              f"migrations {row['migrations']} ({row['migration_ms_each']:.0f} ms each; "
              f"{row['timed_migration_share']:.1%} of the timed steps)  "
              f"dropped {row['dropped_fraction']:.2%}  load {row['load_before']['1min']}",
              flush=True)
  result = {"args": vars(args), "variants": {v: VARIANTS[v] for v in args.variants},
            "rows": rows, "ratios": ratios(rows, args.variants, args.repeats, args.base),
            "command": command("placement.replan_overhead", argv)}
  for v, r in result["ratios"].items():
    print(f"{v} over {args.base}: median step {r['median_step']['median']:.3f}x, mean step "
          f"{r['mean_step']['median']:.3f}x (per repeat: "
          f"{', '.join(f'{x:.3f}' for x in r['mean_step']['per_repeat'])})")
  write_result(result, args.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
