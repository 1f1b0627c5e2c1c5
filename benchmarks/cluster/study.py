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
import dataclasses
import math
import os
import time

from benchmarks.cluster import programs, replays, routing
from benchmarks.common import RESULTS, command, stamp, write_result
from moejax.strategy.hardware import GPU_RATES

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
  """What the trainer pays per step beside the program: the re-plan time (the planner's CPU
  time per layer decision, `replays.decision_time`, times the model's layers) beyond the step in
  flight (the loop plans on its thread while the previous step runs: it reads step t-2's
  counts after dispatching t-1), once per `every` steps; the ep migrations (weights and both
  Adam moments, on the device), spread over the replay's steps."""
  per_layer_ms = (rp.get("decision") or {}).get("cpu_ms_per_layer")
  if per_layer_ms is None:
    per_layer_ms = rp["planner_ms_per_layer"] or 0.0
  replan_s = per_layer_ms * 1e-3 * model_layers
  exposed = max(0.0, replan_s - step_s) / rp["every"] if rp.get("every") else 0.0
  per_layer_step = rp["migration_s"] / (rp["steps"] * rp["layers"])
  return {"replan_s": replan_s, "replan_exposed_s": exposed,
          "migration_s": per_layer_step * model_layers,
          "migrated_bytes_all_devices": rp["migrated_bytes"] / (rp["steps"] * rp["layers"]) *
          model_layers}


def ragged_exchange(cfg, choices_per_device: float, n_e: int, exposed_s: float,
                    per_host: int = PER_HOST) -> dict:
  """The ragged dispatch's exchange three ways, per step: as compiled (train.py's GPU flags
  decompose `ragged_all_to_all` into a dense all-to-all whose every peer chunk is padded to
  the whole buffer: `exposed_s`, what the program waits for); the rows that leave each device
  (6 exchanges a layer: dispatch and combine, forward, the remat's forward, backward) at the
  rate XLA's own ragged_all_to_all reached in openxla/xla#33386 (8 x B200: 2% of NVLink inside
  a node, the NIC's rate across nodes; applied to NVLink 4's 450 GB/s); and the same rows at
  the all-to-all rate of `moejax.strategy.hardware` (an all-to-all-v as fast as NCCL's
  all-to-all)."""
  link = GPU_RATES["h100"].node if n_e <= per_host else GPU_RATES["h100"].cluster
  leaving = choices_per_device * (n_e - 1) / n_e
  sent = 6 * leaving * cfg.model.d_model * 2 * cfg.model.num_layers
  native = 0.02 * 450e9 if n_e <= per_host else link.a2a_bytes_per_s.value
  return {"sent_bytes": sent, "compiled_exposed_s": exposed_s,
          "native_rate_bytes_per_s": native, "native_s": sent / native,
          "all_to_all_v_s": sent / link.a2a_bytes_per_s.value}


def program_at(cache: programs.Cache, spec: programs.Spec, top: float, hlo_dir, log) -> dict:
  """`spec`'s program row at its factor: compiled at 1.0 and at `top` (the largest factor a
  routing needs of this kind), linear between them (every buffer-sized term is linear in the
  factor: the grouped matmul's rows, the exchange's bytes, the buffer's elementwise passes)."""
  lo = cache.get(dataclasses.replace(spec, factor=1.0), hlo_dir=hlo_dir, log=log)
  if spec.factor == 1.0 or top == 1.0:
    return {**lo, "programs": [dataclasses.replace(spec, factor=1.0).key()]}
  hi = cache.get(dataclasses.replace(spec, factor=top), hlo_dir=hlo_dir, log=log)
  keys = [dataclasses.replace(spec, factor=f).key() for f in (1.0, top)]
  if not (lo["compiled"] and hi["compiled"]):
    return {"compiled": False, "error": lo.get("error") or hi.get("error"), "programs": keys}
  return {**programs.interpolate(lo, hi, 1.0, top, spec.factor), "programs": keys}


PUBLISHED = ("mixtral_8x7b", 64)     # Megatron-Core's published run (benchmarks.published_mixtral)
ORDER = (("mixtral_8x7b", 64), ("qwen3_30b_a3b", 64), ("qwen3_30b_a3b", 256),
         ("mixtral_8x7b", 8), ("qwen3_30b_a3b", 8))


def run(models, gpus_by_model, routings, policies, cache: programs.Cache, grid: float,
        steps: int | None, layers: int = 0, hlo_dir: str | None = None, log=print,
        done=None) -> dict:
  """The study's rows (module doc); `done(result)` is called after each (model, GPU count)
  with the rows so far."""
  rows, replay_rows, denominators = [], {}, {}
  cases = [(m, n) for m, n in ORDER if m in models and n in gpus_by_model[m]]
  cases += [(m, n) for m in models for n in gpus_by_model[m] if (m, n) not in cases]
  for model, n in cases:
    topo = topology(n)
    base = programs.Spec(model, topo, "ep", 1.0, layers, fsdp(model, n))
    cfg = programs.run_config(base)
    n_e = cfg.mesh.expert
    k, e = cfg.moe.top_k, cfg.moe.num_experts
    tokens = cfg.data.seq_len * programs.SEQUENCES_PER_GPU
    for name in routings:                  # the planners first: they say which buffers
      key = f"{model}/{n_e}/{name}"
      if key in replay_rows:
        continue
      counts = routing.routing(name, e, n_e, tokens * k, k, steps)
      replay_rows[key] = {"skew": routing.skew(counts), "policies": {}}
      for policy in policies:
        tick = time.perf_counter()
        rp = replays.replay_policy(cfg, policy, counts, n_e)
        rp["replay_s"] = round(time.perf_counter() - tick, 1)
        replay_rows[key]["policies"][policy] = rp
        log(f"replayed {key} {policy}: factor {rp['capacity_factor']:.3f}, busiest "
            f"{rp['busiest_over_mean']:.3f} ({rp['replay_s']} s)")
    need = {(name, p): on_grid(replay_rows[f"{model}/{n_e}/{name}"]["policies"][p]
                               ["capacity_factor"], grid) for name in routings for p in policies}
    top = {}
    for (_, p), f in need.items():
      kind = programs.KIND_OF_POLICY[p]
      top[kind] = max(top.get(kind, 1.0), f)
    den = cache.get(base, hlo_dir=hlo_dir, log=log)
    if not den["compiled"]:
      log(f"no force-balanced program for {model} at {n} GPUs: {den['error']}")
      continue
    denominators[f"{model}/{n}"] = {"step_s": den["step_s"], "program": base.key()}
    if (model, n) == PUBLISHED:        # static EP's einsum program beside it, force-balanced
      einsum = dataclasses.replace(base, kind="ep_einsum")
      row = cache.get(einsum, hlo_dir=hlo_dir, log=log)
      if row["compiled"]:
        denominators[f"{model}/{n}"]["einsum"] = {"step_s": row["step_s"],
                                                 "program": einsum.key()}
    by_routing = {}
    for name in routings:
      for policy in policies:
        rp = replay_rows[f"{model}/{n_e}/{name}"]["policies"][policy]
        factor = need[name, policy]
        kind = programs.KIND_OF_POLICY[policy]
        prog = program_at(cache, dataclasses.replace(base, kind=kind, factor=factor),
                          top[kind], hlo_dir, log)
        row = {"model": model, "gpus": n, "topology": topo, "expert_axis": n_e,
               "routing": name, "policy": policy, "needed_factor": rp["capacity_factor"],
               "factor": factor, "programs": prog["programs"]}
        if not prog["compiled"]:
          rows.append({**row, "error": prog["error"]})
          continue
        load = replays.busiest(rp["series"], factor)     # the buffer caps the busiest rows
        scaled = programs.busiest_step(prog, load, factor)
        paid = priced(scaled["scaled_step_s"], rp, cfg.model.num_layers)
        step = scaled["scaled_step_s"] + paid["replan_exposed_s"] + paid["migration_s"]
        row.update(busiest_over_mean=load, program_step_s=prog["step_s"],
                   **scaled, **{f"paid_{k}": v for k, v in paid.items()}, step_s=step,
                   tokens_per_s=n * tokens / step, fits=prog["fits"],
                   peak_gib=prog["peak_bytes"] / 2 ** 30,
                   fraction_of_balanced=den["step_s"] / step)
        if policy == "ragged":
          x = ragged_exchange(cfg, tokens * k, n_e, prog["exposed_by"].get("all-to-all", 0.0))
          for way in ("native", "all_to_all_v"):
            alt = step - x["compiled_exposed_s"] + x[f"{way}_s"]
            x[f"{way}_step_s"] = alt
            x[f"{way}_fraction_of_balanced"] = den["step_s"] / alt
          row["ragged_exchange"] = x
        by_routing.setdefault(name, {})[policy] = row
        rows.append(row)
    for got in by_routing.values():
      static = got.get("static")
      for row in got.values():
        row["speedup_over_static"] = static["step_s"] / row["step_s"] if static else None
        if "ragged_exchange" in row and static:
          for way in ("native", "all_to_all_v"):
            row["ragged_exchange"][f"{way}_speedup_over_static"] = (
                static["step_s"] / row["ragged_exchange"][f"{way}_step_s"])
    if done is not None:
      done(_result(rows, replay_rows, denominators))
  return _result(rows, replay_rows, denominators)


def _result(rows, replay_rows, denominators) -> dict:
  """The rows, the replays without their per-step series, the denominators."""
  replays_out = {key: {**got, "policies": {p: {k: v for k, v in rp.items() if k != "series"}
                                           for p, rp in got["policies"].items()}}
                 for key, got in replay_rows.items()}
  return {"rows": list(rows), "replays": replays_out, "denominators": dict(denominators)}


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
                  help="8 GPUs, Mixtral-8x7B, 2 layers, static and fsep_planned, uniform and "
                       "drift_bursts")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  if args.smoke:
    args.models, args.gpus, args.layers = ["mixtral_8x7b"], [8], args.layers or 2
    args.policies, args.routings = ["static", "fsep_planned"], ["uniform", "drift_bursts"]
    args.steps = args.steps or 60
  gpus_by_model = {m: tuple(args.gpus) if args.gpus else GPUS[m] for m in args.models}
  tick = time.perf_counter()
  cache = programs.Cache(args.cache)

  def finish(out: dict, complete: bool) -> dict:
    used = {k for r in out["rows"] for k in r["programs"]}
    used |= {d["program"] for d in out["denominators"].values()}
    used |= {d["einsum"]["program"] for d in out["denominators"].values() if "einsum" in d}
    out.update(command=command("cluster", argv), grid=args.grid, complete=complete,
               wall_s=time.perf_counter() - tick, published=published_mixtral(),
               programs={k: v for k, v in cache.rows.items() if k in used})
    if args.json:
      stamp(out)
      out["metadata"]["machine"]["device"] = (
          f"compile-only H100s (XLA:GPU, jax-cuda12-plugin {_plugin()}) on this CPU host; "
          "replays and planner times on this host")
      write_result(out, args.json, restamp=False)
    return out

  out = finish(run(args.models, gpus_by_model, args.routings, args.policies, cache, args.grid,
                   args.steps, args.layers, args.hlo_dir,
                   done=lambda partial: finish(partial, False)), True)
  for r in out["rows"]:
    if "step_s" in r:
      print(f"{r['model']:<14}{r['gpus']:>4} {r['routing']:<17}{r['policy']:<14}"
            f"cf {r['needed_factor']:.3f}->{r['factor']:.3f} step {r['step_s']:.3f} s "
            f"{r['tokens_per_s']:>10,.0f} tok/s  {r['fraction_of_balanced']:.3f} of balanced  "
            f"{r['speedup_over_static'] or 0:.2f}x static")
  return 0
