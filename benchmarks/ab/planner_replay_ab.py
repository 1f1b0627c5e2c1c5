"""Every fsep planner call that replay makes on the committed traces, planned by this tree and
by an earlier commit: are the plans the same, bit for bit?

The replay results in benchmarks/placement/results/ were recorded with the planner of their day;
a later change to the planner keeps them valid only if it plans every one of those calls the
same. The calls are the ones `python -m moejax.replay --slots 8 --every 10 --window 10
--window_oracle` makes: the lagged decisions (every 10 steps, the last 10 steps' mean and the
steps themselves), the window oracle's (the next 10 steps) and the oracle's (each step's own
counts, no window), for each trace and device count the results hold, with the default options
and with locality=False (the crossing-blind plan). --adaptive shares and capacity runs call the
planner the same way. The earlier planner is loaded from git (`benchmarks.ab.base.load_base`).
Exit status 1 where any plan differs.

Run (from the repository root; ~12,000 calls of each planner, about 2 minutes):

  python -m benchmarks.ab.planner_replay_ab --base dce12c7
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile

import numpy as np

from benchmarks.ab.base import load_base, same_plan
from benchmarks.common import command, default_cost, start, write_result
from moejax.layout import host_layout as placement_lib
from moejax.placement import fsep
from moejax.placement.policies import predict

DEFAULT_JSON = "benchmarks/ab/results/planner_replay_ab.json"
TRACES = (("default_run", (2, 4, 8)), ("drift_bursts", (8,)),
          ("synthetic_skewed", (8, 16)), ("synthetic_collapse", (8, 16)))
OPTIONS = ({}, {"locality": False})


def replay_calls(counts: np.ndarray, every: int = 10, window: int = 10) -> list[tuple]:
  """(pred_WxE, samples_stepsxWxE or None) of every planner call replay makes on counts[T, L, W, E]
  (lagged, window oracle, oracle)."""
  steps, layers = counts.shape[:2]
  calls = [(counts[t, layer].astype(np.float64), None)
           for t in range(steps) for layer in range(layers)]
  for t in range(0, steps, every):
    for ahead in (False, True):
      if t == 0 and not ahead:
        continue
      seen = counts[t:t + every] if ahead else counts[max(0, t - window):t]
      pred = seen.mean(0) if ahead else predict(counts[:t], window)
      calls += [(pred[layer], seen[:, layer]) for layer in range(layers)]
  return calls


def compare(base, trace: str, devices: int, options: dict) -> dict:
  counts = np.load(f"benchmarks/traces/{trace}.npz")["counts"]
  experts, sources = counts.shape[3], counts.shape[2]
  src = placement_lib.source_devices(sources, devices)
  current = placement_lib.static(experts, devices)
  calls = replay_calls(counts)
  differ = 0
  for pred, samples in calls:
    plans = [mod.place_replicas(pred, current, slots=8, src_dev_W=src, cost=default_cost(),
                                num_devices=devices, options=mod.FsepOptions(**options),
                                samples_stepsxWxE=samples) for mod in (base, fsep)]
    differ += not same_plan(*plans)
  return {"trace": trace, "devices": devices, "options": options, "calls": len(calls),
          "different_plans": differ}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.ab.planner_replay_ab",
                               description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--base", required=True, help="git revision of the planner to compare with")
  ap.add_argument("--json", default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})")
  a = ap.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    base = load_base(a.base, tmp)
    rows = []
    for trace, device_counts in TRACES:
      for n in device_counts:
        for options in OPTIONS:
          rows.append(compare(base, trace, n, options))
          r = rows[-1]
          print(f"{trace:<20} N={n:<3} {str(options):<20} calls {r['calls']:>5}  "
                f"different plans {r['different_plans']}", flush=True)
  total = sum(r["calls"] for r in rows)
  differ = sum(r["different_plans"] for r in rows)
  print(f"{total} calls, {differ} different plans (this tree vs {a.base}, C=8)")
  write_result({"benchmark": "planner_replay_ab", "command": command("ab.planner_replay_ab", argv),
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "base": a.base, "numpy": np.__version__, "slots": 8, "every": 10, "window": 10,
                "calls": total, "different_plans": differ, "rows": rows}, a.json)
  return 1 if differ else 0


if __name__ == "__main__":
  start()
  sys.exit(main())
