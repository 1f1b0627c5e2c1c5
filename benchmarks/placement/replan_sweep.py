"""Fixed dyn.X (re-plan every 1 / 10 / 50 / 200 steps) against adaptive dyn.X (a candidate after
every step, switched where its priced gain over X steps beats its migration) on a routing
trace: the busiest device's load over the mean (median / p90 / p99 over steps x layers), the
switches, the expert copies moved and the bytes they carry (weights and both Adam moments),
and what the run pays by the cost model: the busiest device's expert compute summed over
steps x layers plus the migrations' seconds.

Every rule plans once as soon as the first step has finished (the trainer's cold start), then
every X steps, or adaptively. SmartMoE (ep) moves weights on a switch; fsep restores every
slot each step, so its switches move nothing. Each cost profile prices the same trace: the
cost model's rates (the default run's model, `strategy.profile`) set how dear a move is
against a step's gain.

Run (from the repository root; host arithmetic, about 4 minutes on the 2-core VM):

  python -m benchmarks.placement.replan_sweep
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks.common import command, default_config, start, write_result
from moejax.placement.trace_replay import replay
from moejax.strategy.cost import load_profile
from moejax.strategy.placement_cost import placement_cost

DEFAULT_JSON = "benchmarks/placement/results/replan_sweep_drift_bursts_N8.json"
FIXED = (1, 10, 50, 200)
ADAPTIVE = (10, 50, 200)          # the horizon a switch must pay back over (planner.every)
KEYS = ("median", "p90", "p99", "switches", "experts_moved", "migrated_bytes", "migration_s",
        "busiest_compute_s", "decisions", "planner_ms_mean")


def rows_for(counts, devices: int, slots: int, window: int, policy: str, cost) -> list[dict]:
  out = []
  for adaptive, every in [(False, x) for x in FIXED] + [(True, x) for x in ADAPTIVE]:
    tick = time.perf_counter()
    r = replay(counts, devices, slots, policy, every, window, cost=cost, adaptive=adaptive)
    row = {"policy": policy, "rule": "adaptive" if adaptive else "fixed", "every": every,
           **{k: r[k] for k in KEYS}}
    row["paid_s"] = row["busiest_compute_s"] + row["migration_s"]
    out.append(row)
    print(f"{policy:<9} {row['rule']:<8} X={every:<4} med {row['median']:.3f} "
          f"p90 {row['p90']:.3f} p99 {row['p99']:.3f} switches {row['switches']:>4} "
          f"moved {row['experts_moved']:>5} bytes {row['migrated_bytes'] / 2**20:9.1f} MiB "
          f"paid {row['paid_s']:.4f} s ({time.perf_counter() - tick:.1f} s)", flush=True)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.placement.replan_sweep",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--trace", default="benchmarks/traces/drift_bursts.npz")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--window", type=int, default=10)
  ap.add_argument("--profiles", default="cpu,h100_node",
                  help="comma-separated strategy.profile presets that price the moves")
  ap.add_argument("--policies", default="smartmoe,fsep")
  ap.add_argument("--json", default=DEFAULT_JSON)
  a = ap.parse_args(argv)
  counts = np.load(a.trace)["counts"]
  cfg = default_config()
  sweeps = []
  for profile in a.profiles.split(","):
    cost = placement_cost(cfg.model, cfg.moe, load_profile(profile))
    print(f"profile {profile}: one expert's move {cost.expert_move_s(1) * 1e3:.3f} ms, "
          f"1000 rows of compute {cost.compute_s(1000) * 1e3:.3f} ms")
    for policy in a.policies.split(","):
      for row in rows_for(counts, a.devices, a.slots, a.window, policy, cost):
        sweeps.append({"profile": profile, **row})
  steps, layers, sources, experts = counts.shape
  write_result({"benchmark": "replan_sweep", "command": command("placement.replan_sweep", argv),
                "trace": a.trace, "devices": a.devices, "slots": a.slots, "window": a.window,
                "steps": steps, "layers": layers, "sources": sources, "experts": experts,
                "d_model": cfg.model.d_model, "d_ff": cfg.moe.d_ff, "rows": sweeps}, a.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
