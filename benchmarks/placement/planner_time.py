"""Planner wall time per decision, for every policy in moejax.placement.policies.POLICIES.

What it measures: the wall time (time.perf_counter) of one policy call
`policy(pred_WxE, current, slots=C, src_dev_W=..., cost=default_cost(), num_devices=N)` for one MoE
layer, as replay and the online trainer make it. The predicted load is one step of a
lognormal synthetic trace (moejax.placement.synthetic.synthetic_trace, sigma=1.0, top_k=2,
2048 tokens per source) with sources = N (one source per device); `current` is the static
placement (fsep ignores it; where E < N it gets any valid layout). Each row: one warm-up
call, then the median (and min, max) over --repeats calls (>= 5). `max/mean` is the busiest
device's load over the mean when the planned layout routes that same predicted load
(placement.route: whole SHARE_PARTS parts, local first).

Configurations: E=64 on N=64 and N=256, plus E=256 on N=256, for every policy. One-copy
policies (static, smartmoe) get C = E/N slots; the others get --slots (default 2); shadow needs
the static base (E/N integer). Rows that cannot exist are printed as "n/a (...)". Then the
fsep latency table: E=64 on N = 64, 256, 1024 and E=256 on N=4096 with C = --fsep_slots
(default 8), with the default options and with exact_parts=False (no snapping/rounding of
shares to router parts). No window of steps is passed, so plan_for='spread' plans for the
mean; per-source shares are computed where an expert has >= 128 rows per device.

The trainer's table (`--trainer`, in the default run; `--trainer_only` alone) times the call
the trainer makes: `OnlinePlanner.propose` of the re-planner `moejax.train.pool.online_planner`
builds for the default config with the policy set (its options, capacity, window and cost
model), for every MoE layer of the default model, after `planner.window` finished steps of
the synthetic load have been observed: fsep (C = --fsep_slots, or E/N where that is more)
at N = 8, 64, 512, 4096 with E = 64 and 256, and SmartMoE under pooled capacity (E/N slots)
where N divides E. Rows give ms per re-plan (all layers) and per layer decision, and name
the options (no SmartMoE row at N = 512 and 4096: E < N, no permutation exists).

Wall time depends on what else the machine runs: the JSON records the 1-minute load average
before and after (`os.getloadavg`); quote a figure beside its load. `--fsep_only` runs only
the fsep latency table.

Run (from the repository root):

  python -m benchmarks.placement.planner_time
  python -m benchmarks.placement.planner_time --repeats 7 \
      --json benchmarks/placement/results/planner_time.json
  python -m benchmarks.placement.planner_time --fsep_only --repeats 21
  python -m benchmarks.placement.planner_time --trainer_only --repeats 21 \
      --json benchmarks/placement/results/planner_time_trainer.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import statistics
import sys
import time

import numpy as np

from benchmarks.common import command, default_cost, start, write_result
from benchmarks.placement.planner_setup import FSEP_CONFIGS, any_layout, trainer_config
from benchmarks.timing import print_table
from moejax.config import num_moe_layers
from moejax.layout import host_layout as placement_lib
from moejax.layout.flow import flow, max_over_mean
from moejax.layout.tables import round_robin_placement
from moejax.placement.policies import ONE_COPY_POLICIES, POLICIES, make_options
from moejax.placement.synthetic import synthetic_trace
from moejax.train.pool import online_planner

DEFAULT_JSON = "benchmarks/placement/results/planner_time.json"
CONFIGS = ((64, 64), (64, 256), (256, 256))     # (experts E, devices N)
TRAINER_CONFIGS = tuple((e, n) for e in (64, 256) for n in (8, 64, 512, 4096))
NEEDS_STATIC_BASE = ("static", "smartmoe", "shadow")


def policy_order() -> list[str]:
  return ["static"] + sorted(p for p in POLICIES if p != "static")


def time_policy(name: str, experts: int, devices: int, slots: int, repeats: int,
                seed: int, options: dict | None = None) -> dict:
  row = {"policy": name, "experts": experts, "devices": devices, "sources": devices}
  one_copy = name in ONE_COPY_POLICIES
  if experts % devices and name in NEEDS_STATIC_BASE:
    why = "E < N" if experts < devices else "E % N != 0"
    return {**row, "slots": None, "status": f"n/a ({why})"}
  c = experts // devices if one_copy else slots
  row["slots"] = c
  if name in NEEDS_STATIC_BASE and c < experts // devices:
    return {**row, "status": f"n/a (slots < E/N={experts // devices})"}
  if devices * c < experts:
    return {**row, "status": f"n/a (N*C < E={experts})"}
  counts = synthetic_trace(1, 1, devices, experts, kind="lognormal", seed=seed)["counts"]
  pred = counts[0, 0].astype(np.float64)
  src = placement_lib.source_devices(devices, devices)
  current, cost, plan = any_layout(experts, devices, c), default_cost(), POLICIES[name]
  if options:
    plan = functools.partial(plan, options=make_options(name, **options))
    row["options"] = options
  times = []
  for i in range(repeats + 1):
    t0 = time.perf_counter()
    out = plan(pred, current, slots=c, src_dev_W=src, cost=cost, num_devices=devices)
    dt = time.perf_counter() - t0
    if i:                                               # the first call is the warm-up
      times.append(dt)
  out.validate(experts)
  ms = [t * 1e3 for t in times]
  balance = max_over_mean(flow(out, counts[0, 0], src).device_load_N)
  return {**row, "status": "ok", "ms_median": statistics.median(ms), "ms_min": min(ms),
          "ms_max": max(ms), "calls": len(ms), "replicas": int(out.replicas(experts).sum()),
          "max_over_mean": balance}


def time_trainer_replan(policy: str, experts: int, devices: int, slots: int, repeats: int,
                        seed: int) -> dict:
  """One re-plan as the trainer makes it (module doc), timed `repeats` times after a warm-up."""
  c = max(slots, -(-experts // devices)) if policy == "fsep" else experts // devices
  cfg = trainer_config(policy, experts, c)
  layers = num_moe_layers(cfg.model, cfg.moe)
  planner = online_planner(cfg, devices)
  steps = synthetic_trace(cfg.planner.window, layers, devices, experts, kind="lognormal",
                          seed=seed)["counts"]
  for counts_LxWxE in steps:
    planner.observe(counts_LxWxE)
  start = (round_robin_placement(experts, devices, c) if policy == "fsep"
           else placement_lib.static(experts, devices))
  times = []
  for i in range(repeats + 1):
    t0 = time.perf_counter()
    planner.propose([start] * layers)
    if i:
      times.append(time.perf_counter() - t0)
  ms = [t * 1e3 for t in times]
  return {"policy": policy, "experts": experts, "devices": devices, "slots": c,
          "layers": layers, "window": cfg.planner.window, "capacity": cfg.moe.capacity,
          "capacity_factor": cfg.moe.capacity_factor,
          "options": dataclasses.asdict(planner.options),
          "cost": dataclasses.asdict(planner.cost), "ms_per_replan_median": statistics.median(ms),
          "ms_per_layer_median": statistics.median(ms) / layers, "ms_per_replan_min": min(ms),
          "ms_per_replan_max": max(ms), "calls": len(ms)}


# The printed tables' columns (keys of the rows).
TRAINER_COLUMNS = ["policy", "experts", "devices", "slots", "layers", "ms_per_replan_median",
                   "ms_per_layer_median", "ms_per_replan_min", "ms_per_replan_max"]
COLUMNS = ["policy", "experts", "devices", "slots", "status", "ms_median", "ms_min", "ms_max",
           "replicas", "max_over_mean"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.placement.planner_time",
                               description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--json", default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls per row (>= 5)")
  ap.add_argument("--slots", type=int, default=2, help="slots per device for non-one-copy")
  ap.add_argument("--fsep_slots", type=int, default=8, help="slots per device, fsep table")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--fsep_only", action="store_true", help="only the fsep latency table")
  ap.add_argument("--trainer", action=argparse.BooleanOptionalAction, default=True,
                  help="the trainer's re-plan table (module doc)")
  ap.add_argument("--trainer_only", action="store_true", help="only the trainer's table")
  a = ap.parse_args(argv)
  if a.repeats < 5:
    ap.error("--repeats must be >= 5")
  load_before = os.getloadavg()[0]
  alone = a.fsep_only or a.trainer_only
  rows = [] if alone else [time_policy(name, e, n, a.slots, a.repeats, a.seed)
                           for e, n in CONFIGS for name in policy_order()]
  if rows:
    print_table(rows, COLUMNS)
  trainer_rows = []
  if (a.trainer and not a.fsep_only) or a.trainer_only:
    for e, n in TRAINER_CONFIGS:
      trainer_rows.append(time_trainer_replan("fsep", e, n, a.fsep_slots, a.repeats, a.seed))
      print_table(trainer_rows[-1:], TRAINER_COLUMNS)
    for e, n in TRAINER_CONFIGS:
      if e % n == 0:     # a permutation needs N to divide E (none at N = 512, 4096)
        trainer_rows.append(time_trainer_replan("smartmoe", e, n, 0, a.repeats, a.seed))
        print_table(trainer_rows[-1:], TRAINER_COLUMNS)
  fsep_rows = []
  if "fsep" in POLICIES and not a.trainer_only:
    fsep_rows = [time_policy("fsep", e, n, a.fsep_slots, a.repeats, a.seed, opts)
                 for opts in (None, {"exact_parts": False}) for e, n in FSEP_CONFIGS]
    print(f"\nfsep latency (C={a.fsep_slots}); last {len(FSEP_CONFIGS)} rows: exact_parts=False "
          "(shares not snapped/rounded to SHARE_PARTS by the planner)")
    print_table(fsep_rows, COLUMNS)
  load_after = os.getloadavg()[0]
  print(f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after "
        f"({os.cpu_count()} cores)")
  out = {"benchmark": "planner_time",
         "command": command("placement.planner_time", argv),
         "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
         "python": platform.python_version(), "numpy": np.__version__,
         "machine": platform.machine(), "processor": platform.processor() or None,
         "repeats": a.repeats, "slots": a.slots, "fsep_slots": a.fsep_slots, "seed": a.seed,
         "workload": "lognormal sigma=1.0, top_k=2, 2048 tokens per source, sources = N",
         "load_average_1min": {"before": load_before, "after": load_after},
         "cpu_count": os.cpu_count(), "rows": rows, "fsep_rows": fsep_rows,
         "trainer_rows": trainer_rows}
  write_result(out, a.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
