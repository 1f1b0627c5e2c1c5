"""The rows of the cluster study and its command line.

Per (model, GPU count, routing, policy): the capacity factor the trainer's planner needs for
<= 1% drops on that routing (`replays`), rounded up to the study's grid (so that routings
share programs); the program compiled at that buffer and its schedule estimate (`programs`),
its grouped matmul scaled to the busiest device's rows; the planner's re-plan time exposed
beyond the step in flight and the ep migrations, per step, as the trainer pays them; tokens
per second, the fraction of the force-balanced throughput (static EP at capacity factor 1.0
under uniform routing) and the speedup over static EP on the same routing.

  python -m benchmarks.cluster --json benchmarks/results/cluster_h100.json
  python -m benchmarks.cluster --smoke      # the smallest case: 8 GPUs, Mixtral-8x7B, 2 layers
"""

from __future__ import annotations

import argparse
import math
import os
import time

from benchmarks.cluster import programs, replays, routing
from benchmarks.common import RESULTS, command, stamp, write_result

# model -> GPU counts (topologies: hosts of 8 GPUs, `moejax.aot.gpus`).
GPUS = {"mixtral_8x7b": (8, 64), "qwen3_30b_a3b": (8, 64, 256)}
POLICIES = tuple(replays.POLICIES)
GRID = 0.125                       # capacity factors are rounded up to a multiple of this
PER_HOST = 8


def topology(n: int) -> str:
  return f"{max(1, n // PER_HOST)}x1x{min(n, PER_HOST)}"


def on_grid(factor: float, grid: float = GRID) -> float:
  """`factor` rounded up to the grid (never below 1.0): a larger buffer drops no more."""
  return max(1.0, math.ceil(round(factor / grid, 6)) * grid)


def fsdp(model: str, n: int) -> bool:
  """FSDP over the data axis where there is one: Mixtral-8x7B's state does not fit 64 H100s
  replicated over 8 data rows (`moejax.plan` picks ep/8x8x1/cf1/fsdp there)."""
  return n > PER_HOST and model == "mixtral_8x7b"


def priced(step_s: float, rp: dict, model_layers: int) -> dict:
  """What the trainer pays per step beside the program: the re-plan time beyond the step in
  flight (the loop plans on its thread while the previous step runs: it reads step t-2's
  counts after dispatching t-1), once per `every` steps; the ep migrations (weights and both
  Adam moments, on the device), spread over the replay's steps."""
  replan_s = (rp["planner_ms_per_layer"] or 0.0) * 1e-3 * model_layers
  exposed = max(0.0, replan_s - step_s) / rp["every"] if rp.get("every") else 0.0
  per_layer_step = rp["migration_s"] / (rp["steps"] * rp["layers"])
  return {"replan_s": replan_s, "replan_exposed_s": exposed,
          "migration_s": per_layer_step * model_layers,
          "migrated_bytes": rp["migrated_bytes"] / (rp["steps"] * rp["layers"]) * model_layers}


def ragged_exchange(cfg, counts_per_device: float, n_e: int, per_host: int = PER_HOST) -> dict:
  """Bytes a device sends in the ragged dispatch's exchanges per step (dispatch and combine,
  forward, the remat's forward and the backward: 6 per layer, of the rows leaving the device),
  and their time at the rate XLA's own ragged_all_to_all reached (openxla/xla#33386, 8 x B200:
  2% of NVLink inside a node, the NIC's rate across nodes), applied to NVLink 4's 450 GB/s."""
  leaving = counts_per_device * (n_e - 1) / n_e
  row = cfg.model.d_model * 2
  layers = cfg.model.num_layers
  sent = 6 * leaving * row * layers
  rate = 0.02 * 450e9 if n_e <= per_host else 40e9
  return {"sent_bytes": sent, "native_rate_bytes_per_s": rate, "native_s": sent / rate}


def run(models, gpus_by_model, routings, policies, cache: programs.Cache, grid: float,
        steps: int | None, layers: int = 0, hlo_dir: str | None = None, log=print) -> dict:
  rows, replay_rows, denominators, base_keys = [], {}, {}, set()
  for model in models:
    for n in gpus_by_model[model]:
      topo = topology(n)
      cfg = programs.config(programs.Spec(model, topo, "ep", 1.0, layers, fsdp(model, n)))
      n_e = cfg.mesh.expert
      k, e = cfg.moe.top_k, cfg.moe.num_experts
      tokens = cfg.data.seq_len * programs.SEQUENCES_PER_GPU
      base = programs.Spec(model, topo, "ep", 1.0, layers, fsdp(model, n))
      den = cache.get(base, hlo_dir=hlo_dir, log=log)
      base_keys.add(base.key())
      if not den["compiled"]:
        log(f"no force-balanced program for {model} at {n} GPUs: {den['error']}")
        continue
      denominators[f"{model}/{n}"] = den["step_s"]
      by_routing = {}
      for name in routings:
        key = f"{model}/{n_e}/{name}"
        counts = routing.routing(name, e, n_e, tokens * k, k, steps)
        if key not in replay_rows:
          replay_rows[key] = {"skew": routing.skew(counts), "policies": {}}
          for policy in policies:
            tick = time.perf_counter()
            rp = replays.replay_policy(cfg, policy, counts, n_e)
            rp["replay_s"] = round(time.perf_counter() - tick, 1)
            replay_rows[key]["policies"][policy] = rp
            log(f"replayed {key} {policy}: factor {rp['capacity_factor']:.3f}, busiest "
                f"{rp['busiest_over_mean']:.3f} ({rp['replay_s']} s)")
        for policy in policies:
          rp = replay_rows[key]["policies"][policy]
          factor = on_grid(rp["capacity_factor"], grid)
          spec = programs.Spec(model, topo, programs.KIND_OF_POLICY[policy], factor, layers,
                               fsdp(model, n))
          prog = cache.get(spec, hlo_dir=hlo_dir, log=log)
          row = {"model": model, "gpus": n, "topology": topo, "expert_axis": n_e,
                 "routing": name, "policy": policy, "needed_factor": rp["capacity_factor"],
                 "factor": factor, "program": spec.key()}
          if not prog["compiled"]:
            rows.append({**row, "error": prog["error"]})
            continue
          scaled = programs.busiest_step(prog, rp["busiest_over_mean"], factor)
          paid = priced(scaled["step_s"], rp, cfg.model.num_layers)
          step = scaled["step_s"] + paid["replan_exposed_s"] + paid["migration_s"]
          row.update(busiest_over_mean=rp["busiest_over_mean"], program_step_s=prog["step_s"],
                     **scaled, **{f"paid_{k}": v for k, v in paid.items()}, step_s=step,
                     tokens_per_s=n * tokens / step, fits=prog["fits"],
                     peak_gib=prog["peak_bytes"] / 2 ** 30)
          if policy == "ragged":
            row["ragged_exchange"] = ragged_exchange(cfg, tokens * k, n_e)
            row["ragged_exchange"]["compiled_all_to_all_s"] = prog["comm_by"].get(
                "all-to-all", 0.0)
          row["fraction_of_balanced"] = den["step_s"] / step
          by_routing.setdefault(name, {})[policy] = row
          rows.append(row)
      for got in by_routing.values():
        static = got.get("static")
        for row in got.values():
          row["speedup_over_static"] = static["step_s"] / row["step_s"] if static else None
  return {"rows": rows, "replays": replay_rows, "denominators": denominators,
          "base": base_keys}


def published_mixtral() -> dict:
  """Megatron-Core's published Mixtral-8x7B step on 64 H100s (benchmarks.published_mixtral)."""
  import json
  with open(os.path.join(RESULTS, "published_mixtral.json")) as f:
    published = json.load(f)["published"]
  return {k: published[k] for k in ("step_s", "tflops_per_gpu", "gpus", "layout", "source")}


def _plugin() -> str:
  import importlib.metadata
  try:
    return importlib.metadata.version("jax-cuda12-plugin")
  except importlib.metadata.PackageNotFoundError:
    return "absent"


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.cluster",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="+", default=list(GPUS), choices=list(GPUS))
  ap.add_argument("--gpus", nargs="+", type=int, default=None,
                  help="GPU counts (default: each model's, GPUS)")
  ap.add_argument("--routings", nargs="+", default=list(routing.ROUTINGS),
                  choices=list(routing.ROUTINGS))
  ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
  ap.add_argument("--grid", type=float, default=GRID)
  ap.add_argument("--steps", type=int, default=None, help="the first N steps of each trace")
  ap.add_argument("--layers", type=int, default=0, help="model layers (0: the model's)")
  ap.add_argument("--cache", default=os.path.expanduser("~/.cache/moejax/cluster_programs.json"),
                  help="program rows by spec, compiled once and read back (the result holds "
                       "every program it used)")
  ap.add_argument("--hlo_dir", default=None)
  ap.add_argument("--smoke", action="store_true",
                  help="8 GPUs, Mixtral-8x7B, 2 layers, static and fsep_planned, the own trace")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  if args.smoke:
    args.models, args.gpus, args.layers = ["mixtral_8x7b"], [8], args.layers or 2
    args.policies, args.routings = ["static", "fsep_planned"], ["uniform", "default_run"]
    args.steps = args.steps or 60
  gpus_by_model = {m: tuple(args.gpus) if args.gpus else GPUS[m] for m in args.models}
  tick = time.perf_counter()
  cache = programs.Cache(args.cache)
  out = run(args.models, gpus_by_model, args.routings, args.policies, cache, args.grid,
            args.steps, args.layers, args.hlo_dir)
  out.update(command=command("cluster", argv), grid=args.grid, wall_s=time.perf_counter() - tick,
             published=published_mixtral())
  for r in out["rows"]:
    if "step_s" in r:
      print(f"{r['model']:<14}{r['gpus']:>4} {r['routing']:<17}{r['policy']:<14}"
            f"cf {r['needed_factor']:.3f}->{r['factor']:.3f} step {r['step_s']:.3f} s "
            f"{r['tokens_per_s']:>10,.0f} tok/s  {r['fraction_of_balanced']:.3f} of balanced  "
            f"{r['speedup_over_static'] or 0:.2f}x static")
  used = {r["program"] for r in out["rows"]}
  out["programs"] = {k: v for k, v in cache.rows.items() if k in used or k in out.pop("base")}
  if args.json:
    stamp(out)
    out["metadata"]["machine"]["device"] = (
        f"compile-only H100s (XLA:GPU, jax-cuda12-plugin {_plugin()}) on this CPU host; replays "
        "and planner times on this host")
    write_result(out, args.json, restamp=False)
  return 0
