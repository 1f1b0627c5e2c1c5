"""SmartMoE under pooled capacity, this tree against an earlier commit: what it plans and what
the plan drops, on the committed traces, and the time of the trainer's call.

Three tables, each planner given the same inputs:
  * traces: every trace in benchmarks/traces on N devices, its sources folded per device (the
    plan's samples are those folded steps, not the trainer's per-row samples), and lognormal
    synthetic ones at E = 64 and 256; a decision every 10 steps from the last 10 (cf 1.25,
    min_gain 0.05, starting from static). `planned`: the drops of the chosen layout on the
    window it was planned on; `realised`: its drops on the 10 steps it then serves, per
    (source, device) buffer of the trace's own sources; max/mean: those steps' device loads.
  * default job: the decisions the trainer's re-planner (`online_planner` of the default
    config, each planner its policy; for SmartMoE it keeps each data row of a step as its own
    sample) makes in the default job, fed a logged run's counts as the trainer reads them (a
    step late, except before an eval or a checkpoint) and asked before every step whether it
    is due (a cold start at step 2, then every 50 steps), and the drops of steps 150-299 as
    train.py's last line counts them.
  * time: `OnlinePlanner.propose` for the default config under pooled capacity (the SmartMoE
    rows of `benchmarks.placement.planner_time --trainer_only`), both planners interleaved call
    by call.

  python -m benchmarks.ab.smartmoe_ab --base aeb3d0a
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.ab.base import load_base
from benchmarks.common import command, default_config, start, write_result
from benchmarks.placement.planner_setup import trainer_config
from moejax.config import num_moe_layers
from moejax.layout import capacity, host_layout as placement_lib
from moejax.placement import smartmoe
from moejax.placement.synthetic import synthetic_trace
from moejax.train.pool import online_planner

TRACES = (("default_run", 4), ("drift_bursts", 8), ("drift_bursts", 16),
          ("synthetic_skewed", 8), ("synthetic_skewed", 16), ("synthetic_collapse", 8),
          ("synthetic_collapse", 16))
SYNTHETIC = ((64, 8, None), (256, 8, None), (256, 64, 4))    # E, N, decisions (None: all)
DEFAULT_JOB_TRACE = "benchmarks/traces/default_smartmoe_run.npz"
TIMED = ((64, 8), (64, 64), (256, 8), (256, 64))
CF, MIN_GAIN = 1.25, 0.05


def _dev(p: placement_lib.Placement, experts: int) -> np.ndarray:
  d = np.empty(experts, np.int64)
  d[p.slot_expert] = p.device_of_slot
  return d


def _plan(mod, hist_stepsxWxE, cur):
  opts = mod.SmartMoEOptions(min_gain=MIN_GAIN, pooled_capacity_factor=CF)
  return mod.place_permutation(hist_stepsxWxE.mean(0), cur, options=opts,
                               samples_stepsxWxE=hist_stepsxWxE)


def replay(mod, counts, n, every=10, window=10, decisions=None) -> dict:
  """counts[T, L, W, E], trace sources expert-major (source s on device s * N // W)."""
  steps, layers, sources, experts = counts.shape
  folded = counts.reshape(steps, layers, n, sources // n, experts).sum(3)
  tally, mom, ms = np.zeros(4), [], []
  for layer in range(layers):
    cur = placement_lib.static(experts, n)
    for t in range(window, steps, every):
      if decisions and len(ms) >= decisions:
        break
      hist = folded[t - window:t, layer]
      t0 = time.perf_counter()
      cur = _plan(mod, hist, cur)
      ms.append(1e3 * (time.perf_counter() - t0))
      d = _dev(cur, experts)
      tally[:2] += smartmoe.pooled_drops(hist, d, n, np.ceil(CF * hist.sum(-1) / n)), hist.sum()
      served = counts[t:t + every, layer]
      load = served @ np.eye(n)[d]
      tally[2:] += np.maximum(load - np.ceil(CF * served.sum(-1) / n)[..., None], 0).sum(), \
          served.sum()
      dev_load = load.sum(1)
      mom += list(dev_load.max(-1) / dev_load.mean(-1))
  return {"planned_dropped": tally[0] / tally[1], "realised_dropped": tally[2] / tally[3],
          "max_over_mean": float(np.mean(mom)), "decisions": len(ms),
          "ms_median": statistics.median(ms)}


def default_job(mod, counts) -> float:
  """Dropped fraction of steps 150-299 under the trainer's decisions (module doc)."""
  steps, layers, _, experts = counts.shape
  cfg = default_config()
  n, top_k = cfg.mesh.expert, cfg.moe.top_k
  planner = online_planner(cfg, n)
  planner.policy = mod.place_permutation
  cur, dropped, choices, read = [placement_lib.static(experts, n)] * layers, 0, 0, 0
  for t in range(steps):
    # Metrics are read a step late, except before an eval or a checkpoint (every 100 steps).
    while read < (t if t % 100 == 0 else t - 1):
      planner.observe(counts[read])
      read += 1
    if planner.due(t):
      cur = planner.propose(cur)[0]
    if t >= steps // 2:
      for layer in range(layers):
        c = counts[t, layer]
        load = c @ np.eye(n)[_dev(cur[layer], experts)]
        cap = capacity.rows("device", int(c.sum(1).max()) // top_k, top_k, n, experts // n, CF)
        dropped += np.maximum(load - cap, 0).sum()
        choices += c.sum()
  return dropped / choices


def time_trainer(base, experts, n, calls) -> dict:
  cfg = trainer_config("smartmoe", experts, experts // n)
  layers = num_moe_layers(cfg.model, cfg.moe)
  planner = online_planner(cfg, n)
  for c in synthetic_trace(cfg.planner.window, layers, n, experts, kind="lognormal",
                           seed=0)["counts"]:
    planner.observe(c)
  start = [placement_lib.static(experts, n)] * layers
  ms = {"base": [], "this": []}
  for i in range(calls + 1):
    for tag in ("base", "this") if i % 2 else ("this", "base"):
      planner.policy = (base if tag == "base" else smartmoe).place_permutation
      t0 = time.perf_counter()
      planner.propose(start)
      if i:                                             # the first round is the warm-up
        ms[tag].append(1e3 * (time.perf_counter() - t0) / layers)
  row = {k: statistics.median(v) for k, v in ms.items()}
  return {"experts": experts, "devices": n, "layers": layers, "calls": calls,
          "ms_per_layer": row, "speedup": row["base"] / row["this"],
          "options": {"min_gain": cfg.planner.min_gain, "pooled_capacity_factor":
                      cfg.moe.capacity_factor, "window": cfg.planner.window}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.ab.smartmoe_ab",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--base", required=True, help="git revision of the earlier planner")
  ap.add_argument("--calls", type=int, default=21, help="timed calls per planner and size")
  ap.add_argument("--json", default="benchmarks/ab/results/smartmoe_ab.json")
  a = ap.parse_args(argv)
  load_base(a.base, tempfile.mkdtemp())          # the earlier moejax.placement as base_placement
  base = importlib.import_module("base_placement.smartmoe")
  load_before = os.getloadavg()[0]
  traces = []
  cases = [(name, n, np.load(f"benchmarks/traces/{name}.npz")["counts"].astype(np.float64), None)
           for name, n in TRACES]
  cases += [(f"lognormal_E{e}", n, synthetic_trace(70, 1, n, e, kind="lognormal", seed=1)[
      "counts"].astype(np.float64), d) for e, n, d in SYNTHETIC]
  for name, n, counts, decisions in cases:
    row = {"trace": name, "experts": counts.shape[-1], "devices": n,
           "base": replay(base, counts, n, decisions=decisions),
           "this": replay(smartmoe, counts, n, decisions=decisions)}
    traces.append(row)
    print(name, n, {k: {m: round(v, 5) for m, v in row[k].items()} for k in ("base", "this")},
          flush=True)
  counts = np.load(DEFAULT_JOB_TRACE)["counts"].astype(np.float64)
  job = {tag: default_job(mod, counts) for tag, mod in (("base", base), ("this", smartmoe))}
  print("default job, steps 150-299 dropped:", {k: f"{v:.4%}" for k, v in job.items()})
  timed = []
  for e, n in TIMED:
    timed.append(time_trainer(base, e, n, a.calls if e * n < 256 * 64 else max(5, a.calls // 4)))
    print(timed[-1], flush=True)
  load_after = os.getloadavg()[0]
  write_result({"benchmark": "smartmoe_ab", "command": command("ab.smartmoe_ab", argv),
                "base": a.base, "capacity_factor": CF, "min_gain": MIN_GAIN, "traces": traces,
                "default_job": job, "default_job_trace": DEFAULT_JOB_TRACE, "time": timed,
                "load_average_1min": {"before": load_before, "after": load_after}}, a.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
