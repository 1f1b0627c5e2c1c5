"""The fsep planner of this tree against the one of an earlier commit, in one process: the same
plans (every returned array bit for bit) and the time per decision, interleaved call by call.

From fsep.deal.LARGE_MESH devices on (decision 0056) the planner's sums run in other orders
and exact ties in rounding go to the lower position, so plans there may differ from a base
before it; each row also reports both plans' planned balance (the busiest device's quota load
over the mean, on the load planned for), and the exit status is 1 only when a plan below
LARGE_MESH differs.

  python -m benchmarks.ab.planner_ab --base c2974b0
  python -m benchmarks.ab.planner_ab --base c2974b0 --rounds 11 \
      --json benchmarks/ab/results/planner_ab.json

`main`'s docstring says how.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.ab.base import load_base, same_plan
from benchmarks.common import command, default_cost, start, write_result
from benchmarks.placement.planner_setup import FSEP_CONFIGS, any_layout
from benchmarks.timing import print_table
from moejax.layout.flow import max_over_mean
from moejax.placement import fsep
from moejax.placement.fsep.deal import LARGE_MESH
from moejax.placement.synthetic import synthetic_trace

DEFAULT_JSON = "benchmarks/ab/results/planner_ab.json"


def _plan(mod, pred, current, n):
  return mod.place_replicas(pred, current, slots=8, src_dev_W=np.arange(n), cost=default_cost(),
                            num_devices=n, options=mod.FsepOptions())


def compare(base, experts: int, devices: int, rounds: int, calls: int, seed: int) -> dict:
  pred = synthetic_trace(1, 1, devices, experts, kind="lognormal",
                         seed=seed)["counts"][0, 0].astype(np.float64)
  current = any_layout(experts, devices, 8)
  plans = {"base": _plan(base, pred, current, devices), "new": _plan(fsep, pred, current, devices)}
  same = same_plan(plans["base"], plans["new"])
  load_E = pred.sum(0)
  balance = {f"max_over_mean_{k}": max_over_mean(np.bincount(
      np.arange(len(p.share)) // 8, weights=p.share * load_E[p.slot_expert], minlength=devices))
      for k, p in plans.items()}
  wall = {"base": [], "new": []}
  cpu = {"base": [], "new": []}
  for _ in range(rounds):
    for name, mod in (("base", base), ("new", fsep)):
      for _ in range(calls):
        t0, c0 = time.perf_counter(), time.process_time()
        _plan(mod, pred, current, devices)
        cpu[name].append(time.process_time() - c0)
        wall[name].append(time.perf_counter() - t0)
  med = {f"{kind}_{k}_ms": 1e3 * statistics.median(v[k])
         for kind, v in (("wall", wall), ("cpu", cpu)) for k in v}
  return {"experts": experts, "devices": devices, "slots": 8, "same_plan": same, **balance, **med,
          "wall_ratio": med["wall_new_ms"] / med["wall_base_ms"],
          "cpu_ratio": med["cpu_new_ms"] / med["cpu_base_ms"]}


def main(argv=None) -> int:
  """Times taken minutes apart on a shared VM move with what else runs; a ratio taken call by call
  in one process holds up better (decision 0035). The earlier planner is moejax/placement at
  --base (a git revision), copied by `git archive` into a temporary package whose imports point at
  itself; both run on the benchmark load of `benchmarks.placement.planner_time` (one lognormal
  step, top-2, 2048 tokens per source, sources = N, C = 8, default options). Each row: --rounds
  rounds, each `--calls` calls of the base planner then as many of this one; median wall
  (perf_counter) and CPU (process_time) ms, and their ratio new / base. The 1-minute load average
  is recorded before and after. Needs git and the repository's history.

  Run (from the repository root):
  """
  ap = argparse.ArgumentParser(prog="python -m benchmarks.ab.planner_ab",
                               description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--base", required=True, help="git revision of the planner to compare with")
  ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per row")
  ap.add_argument("--calls", type=int, default=5, help="calls of each planner per round")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})")
  a = ap.parse_args(argv)
  if a.rounds < 1 or a.calls < 1:
    ap.error(f"--rounds {a.rounds} and --calls {a.calls} must be >= 1")
  load_before = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as tmp:
    base = load_base(a.base, tmp)
    rows = [compare(base, e, n, a.rounds, a.calls, a.seed) for e, n in FSEP_CONFIGS]
  load_after = os.getloadavg()[0]
  print(f"fsep planner, this tree vs {a.base} (C=8; median ms over {a.rounds} x {a.calls} calls)")
  print_table(rows, ["experts", "devices", "same_plan", "max_over_mean_base",
                     "max_over_mean_new", "wall_base_ms", "wall_new_ms", "wall_ratio",
                     "cpu_base_ms", "cpu_new_ms", "cpu_ratio"])
  print(f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after "
        f"({os.cpu_count()} cores)")
  write_result({"benchmark": "planner_ab", "command": command("ab.planner_ab", argv),
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "base": a.base, "numpy": np.__version__, "rounds": a.rounds, "calls": a.calls,
                "seed": a.seed, "load": "lognormal sigma=1.0, top_k=2, 2048 tokens per source",
                "load_average_1min": {"before": load_before, "after": load_after},
                "cpu_count": os.cpu_count(), "rows": rows}, a.json)
  return 0 if all(r["same_plan"] for r in rows if r["devices"] < LARGE_MESH) else 1


if __name__ == "__main__":
  start()
  sys.exit(main())
