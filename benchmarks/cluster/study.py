"""The rows of the cluster study and its command line.

Per (model, GPU count, routing, policy): the capacity factor the trainer's planner needs for
<= 1% drops on that routing (`replays`), rounded up to the study's grid (so that routings
share programs); the program compiled at that buffer and its schedule estimate (`programs`),
its grouped matmul scaled to the busiest device's rows; the planner's re-plan time exposed
beyond the step in flight and the ep migrations, per step, as the trainer pays them; tokens
per second, the fraction of the force-balanced throughput (static EP at capacity factor 1.0
under uniform routing) and the speedup over static EP on the same routing. A dense policy is
compiled on both expert kernels (pooled buffers through the grouped matmul, per-slot buffers
through XLA's einsum, each at the factor its buffers need), and where the model's config keeps
the MoE exchanges for the rematerialised backward, each again recomputing them (the kept
buffers grow with the factor: past the GPU's memory they do not fit, and past XLA's memory
limit its scheduler overlaps less); the row is the fastest program that fits, the others kept
beside it; the force-balanced step is static EP's fastest one.

With `--depths A B` every program is compiled at A and at B layers and its row (step, each
category and collective and its exposure, grouped matmul, peak) extrapolated to the model's
depth (`programs.extrapolate`); the planner's time and the migrations are priced per model
layer either way. The rows say so (`extrapolated_from`).

  python -m benchmarks.cluster.study --json benchmarks/cluster/results/cluster_h100.json
  python -m benchmarks.cluster.study --models qwen3_30b_a3b --gpus 8 --depths 2 4
  python -m benchmarks.cluster.study --smoke     # the smallest case: 8 GPUs, Mixtral-8x7B, 2 layers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from benchmarks.cluster import programs, replays, routing
from benchmarks.common import BENCHMARKS, command, stamp, start, write_result
from moejax.config import Config
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


def program_at(cache: programs.Cache, spec: programs.Spec, top: float, hlo_dir, log,
               depths=None) -> dict:
  """`spec`'s program row at its factor: compiled at 1.0 and at `top` (the largest factor a
  routing needs of this kind), linear between them (every buffer-sized term is linear in the
  factor: the grouped matmul's rows, the exchange's bytes, the buffer's elementwise passes);
  each of the two at `depths` and extrapolated to the model's depth where given
  (`programs.at_depth`)."""
  lo = programs.at_depth(cache, dataclasses.replace(spec, factor=1.0), depths, hlo_dir, log)
  if spec.factor == 1.0 or top == 1.0:
    return lo
  hi = programs.at_depth(cache, dataclasses.replace(spec, factor=top), depths, hlo_dir, log)
  keys = lo["programs"] + hi["programs"]
  if not (lo["compiled"] and hi["compiled"]):
    return {"compiled": False, "error": lo.get("error") or hi.get("error"), "programs": keys}
  return {**programs.interpolate(lo, hi, 1.0, top, spec.factor), "programs": keys,
          **({"extrapolated": lo["extrapolated"]} if depths else {})}


# Megatron-Core's published run (benchmarks.gpu.published_mixtral).
PUBLISHED = ("mixtral_8x7b", 64)
# The goal cases first (64 and 256 GPUs), so that a run cut short has them.
ORDER = (("mixtral_8x7b", 64), ("qwen3_30b_a3b", 64), ("qwen3_30b_a3b", 256),
         ("mixtral_8x7b", 8), ("qwen3_30b_a3b", 8))


@dataclasses.dataclass
class Case:
  """One (model, GPU count): its force-balanced program spec and the run config it starts
  from (the planners are told that config's capacity factor)."""
  model: str
  gpus: int
  base: programs.Spec
  cfg: Config

  @classmethod
  def of(cls, model: str, gpus: int, layers: int = 0) -> Case:
    base = programs.Spec(model, topology(gpus), "ep", 1.0, layers, fsdp(model, gpus))
    return cls(model, gpus, base, programs.run_config(base))

  @property
  def expert_axis(self) -> int:
    return self.cfg.mesh.expert

  @property
  def tokens(self) -> int:
    """Tokens per GPU a step."""
    return self.cfg.data.seq_len * programs.SEQUENCES_PER_GPU

  def replay_key(self, routing_name: str) -> str:
    return f"{self.model}/{self.expert_axis}/{routing_name}"


def cases(models, gpus_by_model) -> list[tuple[str, int]]:
  """The (model, GPU count) cases in ORDER, then any other asked for."""
  pairs = [(m, n) for m, n in ORDER if m in models and n in gpus_by_model[m]]
  pairs += [(m, n) for m in models for n in gpus_by_model[m] if (m, n) not in pairs]
  return pairs


def replay_case(case: Case, routings, policies, steps: int | None, replay_rows: dict,
                log=print) -> None:
  """Each routing's skew and each policy's replay on it, into `replay_rows` under
  `case.replay_key(routing)` (a routing replayed for another GPU count with the same expert
  axis is not replayed again)."""
  k, e, n_e = case.cfg.moe.top_k, case.cfg.moe.num_experts, case.expert_axis
  for name in routings:
    key = case.replay_key(name)
    if key in replay_rows:
      continue
    counts = routing.routing(name, e, n_e, case.tokens * k, k, steps)
    replay_rows[key] = {"skew": routing.skew(counts), "policies": {}}
    for policy in policies:
      tick = time.perf_counter()
      rp = replays.replay_policy(case.cfg, policy, counts, n_e)
      rp["replay_s"] = round(time.perf_counter() - tick, 1)
      replay_rows[key]["policies"][policy] = rp
      log(f"replayed {key} {policy}: factor {rp['capacity_factor']:.3f}, busiest "
          f"{rp['busiest_over_mean']:.3f} ({rp['replay_s']} s)")


def needed(rp: dict, kernels: str) -> float:
  """The factor a replayed policy needs for <= 1% drops in the buffers `kernels` runs:
  pooled per (source, device) for the grouped kernel, per (source, slot) for the einsum (read
  from the same replay, whose planner is told pooled capacity as the trainer's default is)."""
  return rp["capacity_factor"] if kernels == "grouped" else rp["slot_capacity_factor"]


def buffers(case: Case, routings, policies, replay_rows: dict, grid: float,
            kernels=("grouped",)):
  """({(routing, policy, kernels): the factor compiled, on the grid}, {program kind: the
  largest})."""
  need = {(name, p, k): on_grid(needed(replay_rows[case.replay_key(name)]["policies"][p], k),
                                grid)
          for name in routings for p in policies for k in programs.kernels_of(p, kernels)}
  top: dict[str, float] = {}
  for (_, p, k), f in need.items():
    kind = programs.kind_of(p, k)
    top[kind] = max(top.get(kind, 1.0), f)
  return need, top


def denominator(case: Case, cache: programs.Cache, hlo_dir, log, depths=None,
                kernels=("grouped",)) -> dict | None:
  """The force-balanced step (static EP at factor 1.0 under uniform routing: the fraction's
  denominator): static EP's program on `kernels` picked as a policy's is (`fastest_fitting`),
  so that static EP's uniform row is the denominator; each compiled program beside it (at the
  published case the einsum one either way); None if none compiled."""
  shown = list(kernels) + (["einsum"] if (case.model, case.gpus) == PUBLISHED and
                           "einsum" not in kernels else [])
  rows, usable = {}, []
  for k, recomputed in variants(case, "static", tuple(shown)):
    key = k + (programs.RECOMPUTED if recomputed else "")
    row = programs.at_depth(cache, dataclasses.replace(case.base, kind=programs.kind_of(
        "static", k, recomputed)), depths, hlo_dir, log)
    if row["compiled"]:
      rows[key] = row
      if k in kernels:
        usable.append({**row, "key": key, "kernels": k, "exchange_recomputed": recomputed})
    else:
      log(f"no force-balanced {key} program for {case.model} at {case.gpus} GPUs: "
          f"{row['error']}")
  if not usable:
    return None
  best = fastest_fitting(usable)
  pick = best["key"]
  return {"step_s": rows[pick]["step_s"], "programs": rows[pick]["programs"],
          "kernels": best["kernels"], "exchange_recomputed": best["exchange_recomputed"],
          "extrapolated_from": rows[pick].get("extrapolated"),
          **{k: {"step_s": r["step_s"], "programs": r["programs"], "fits": r["fits"]}
             for k, r in rows.items()}}


def policy_row(case: Case, name: str, policy: str, rp: dict, factor: float, top: float,
               den_step_s: float, cache: programs.Cache, hlo_dir, log, depths=None,
               kernels: str = "grouped", recomputed: bool = False) -> dict:
  """One row (module doc): the program on `kernels` at `factor` (at the model's depth, or
  extrapolated to it from `depths`; with `recomputed` its twin that runs the MoE exchange
  again in the backward), its grouped matmul scaled to the busiest device, what the trainer
  pays beside it, and ragged's exchange priced three ways."""
  kind = programs.kind_of(policy, kernels, recomputed)
  prog = program_at(cache, dataclasses.replace(case.base, kind=kind, factor=factor), top,
                    hlo_dir, log, depths)
  row = {"model": case.model, "gpus": case.gpus, "topology": case.base.topology,
         "expert_axis": case.expert_axis, "routing": name, "policy": policy,
         "kernels": kernels, "exchange_recomputed": recomputed,
         "needed_factor": needed(rp, kernels), "factor": factor,
         "layers": case.cfg.model.num_layers, "extrapolated_from": prog.get("extrapolated"),
         "programs": prog["programs"]}
  if not prog["compiled"]:
    return {**row, "error": prog["error"]}
  load = replays.busiest(rp["series"], factor)       # the buffer caps the busiest rows
  scaled = programs.busiest_step(prog, load, factor)
  paid = priced(scaled["scaled_step_s"], rp, case.cfg.model.num_layers)
  step = scaled["scaled_step_s"] + paid["replan_exposed_s"] + paid["migration_s"]
  row.update(busiest_over_mean=load, program_step_s=prog["step_s"],
             program_compute_s=prog["compute_s"], program_exposed_comm_s=prog["exposed_comm_s"],
             program_grouped_matmul_s=prog["grouped_matmul"]["seconds"], **scaled,
             **{f"paid_{k}": v for k, v in paid.items()}, step_s=step,
             tokens_per_s=case.gpus * case.tokens / step, fits=prog["fits"],
             peak_gib=prog["peak_bytes"] / 2 ** 30, fraction_of_balanced=den_step_s / step)
  if policy == "ragged":
    x = ragged_exchange(case.cfg, case.tokens * case.cfg.moe.top_k, case.expert_axis,
                        prog["exposed_by"].get("all-to-all", 0.0))
    for way in ("native", "all_to_all_v"):
      alt = step - x["compiled_exposed_s"] + x[f"{way}_s"]
      x[f"{way}_step_s"] = alt
      x[f"{way}_fraction_of_balanced"] = den_step_s / alt
    row["ragged_exchange"] = x
  return row


def variants(case: Case, policy: str, kernels: tuple[str, ...]) -> list[tuple[str, bool]]:
  """(kernels, exchange recomputed) of every program a policy's row is picked from: each of
  `kernels`, and where the model's config keeps the MoE exchanges for the backward each again
  recomputing them (ragged keeps nothing)."""
  again = policy != "ragged" and programs.keeps_exchange(case.cfg, policy.startswith("fsep"))
  return [(k, r) for r in ((False, True) if again else (False,))
          for k in programs.kernels_of(policy, kernels)]


def fastest_fitting(rows: list[dict]) -> dict:
  """The fastest of compiled `rows` that fits, the fastest of all where none fits."""
  return min([r for r in rows if r["fits"]] or rows, key=lambda r: r["step_s"])


def faster(rows: list[dict]) -> dict:
  """A policy's row on the kernels that pay (`fastest_fitting`), the others listed under
  `alternatives`."""
  ok = [r for r in rows if "step_s" in r]
  pick = fastest_fitting(ok) if ok else rows[0]
  others = [{k: r.get(k) for k in ("kernels", "exchange_recomputed", "needed_factor", "factor",
                                  "step_s", "fits", "peak_gib", "programs", "error")}
            for r in rows if r is not pick]
  return {**pick, "alternatives": others} if others else pick


def against_static(rows_by_policy: dict[str, dict]) -> None:
  """Each row's speedup over static EP on the same routing (ragged's exchange ways too)."""
  static = rows_by_policy.get("static")
  for row in rows_by_policy.values():
    row["speedup_over_static"] = static["step_s"] / row["step_s"] if static else None
    if "ragged_exchange" in row and static:
      for way in ("native", "all_to_all_v"):
        row["ragged_exchange"][f"{way}_speedup_over_static"] = (
            static["step_s"] / row["ragged_exchange"][f"{way}_step_s"])


def run(models, gpus_by_model, routings, policies, cache: programs.Cache, grid: float,
        steps: int | None, layers: int = 0, hlo_dir: str | None = None, log=print,
        done=None, depths: tuple[int, int] | None = None,
        kernels: tuple[str, ...] = programs.KERNELS) -> dict:
  """The study's rows (module doc), case by case in ORDER: the planners first (they say which
  buffers), then the programs (at `layers`, 0: the model's depth; or compiled at the two
  `depths` and extrapolated to the model's), each dense policy on every one of its
  `variants` (each of `kernels`, keeping and recomputing the exchange where the model keeps
  it), its row the one that pays (`faster`). `done(result)` is called after each case with the
  rows so far."""
  if depths and layers:
    raise ValueError(f"depths={depths} and layers={layers}: the depths extrapolate to the "
                     "model's depth; give one of them")
  rows, replay_rows, denominators = [], {}, {}
  for model, n in cases(models, gpus_by_model):
    case = Case.of(model, n, layers)
    replay_case(case, routings, policies, steps, replay_rows, log)
    need, top = buffers(case, routings, policies, replay_rows, grid, kernels)
    den = denominator(case, cache, hlo_dir, log, depths, kernels)
    if den is None:
      continue
    denominators[f"{model}/{n}"] = den
    for name in routings:
      got = {}
      for policy in policies:
        rp = replay_rows[case.replay_key(name)]["policies"][policy]
        row = faster([policy_row(case, name, policy, rp, need[name, policy, k],
                                 top[programs.kind_of(policy, k)], den["step_s"], cache,
                                 hlo_dir, log, depths, k, recomputed)
                      for k, recomputed in variants(case, policy, kernels)])
        rows.append(row)
        if "step_s" in row:
          got[policy] = row
      against_static(got)
    if done is not None:
      done(result(rows, replay_rows, denominators))
  return result(rows, replay_rows, denominators)


def result(rows, replay_rows, denominators) -> dict:
  """The rows, the replays without their per-step series, the denominators."""
  replays_out = {key: {**got, "policies": {p: {k: v for k, v in rp.items() if k != "series"}
                                           for p, rp in got["policies"].items()}}
                 for key, got in replay_rows.items()}
  return {"rows": list(rows), "replays": replays_out, "denominators": dict(denominators)}


def published_mixtral() -> dict:
  """Megatron-Core's published Mixtral-8x7B step on 64 H100s (benchmarks.gpu.published_mixtral)."""
  with open(os.path.join(BENCHMARKS, "gpu", "results", "published_mixtral.json")) as f:
    published = json.load(f)["published"]
  return {k: published[k] for k in ("step_s", "tflops_per_gpu", "gpus", "layout", "source")}


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.cluster.study",
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
  ap.add_argument("--depths", nargs=2, type=int, default=None, metavar=("A", "B"),
                  help="compile every program at A and at B layers and extrapolate its row "
                       "to the model's depth (faster than compiling the full depth)")
  ap.add_argument("--cache", default=os.path.expanduser("~/.cache/moejax/cluster_programs.json"),
                  help="program rows by spec, compiled once and read back (the result holds "
                       "every program it used)")
  ap.add_argument("--kernels", nargs="+", default=list(programs.KERNELS),
                  choices=list(programs.KERNELS),
                  help="the expert kernels each dense policy is compiled on; its row takes the "
                       "faster program that fits")
  ap.add_argument("--hlo_dir", default=None)
  ap.add_argument("--smoke", action="store_true",
                  help="8 GPUs, Mixtral-8x7B, 2 layers, static and fsep_planned, uniform and "
                       "drift_bursts")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  if args.depths and (args.layers or args.depths[0] == args.depths[1] or min(args.depths) < 1):
    ap.error(f"--depths {args.depths} with --layers {args.layers}: give two different depths "
             ">= 1 and no --layers (the depths extrapolate to the model's depth)")
  if args.smoke:
    args.models, args.gpus = ["mixtral_8x7b"], [8]
    args.layers = args.layers or (0 if args.depths else 2)
    args.policies, args.routings = ["static", "fsep_planned"], ["uniform", "drift_bursts"]
    args.steps = args.steps or 60
  gpus_by_model = {m: tuple(args.gpus) if args.gpus else GPUS[m] for m in args.models}
  tick = time.perf_counter()
  cache = programs.Cache(args.cache)

  def finish(out: dict, complete: bool) -> dict:
    used = {k for r in out["rows"] for k in r["programs"]}
    used |= {k for r in out["rows"] for a in r.get("alternatives", ()) for k in a["programs"]}
    used |= {k for d in out["denominators"].values() for k in d["programs"]}
    used |= {k for d in out["denominators"].values() for other in ("einsum", "grouped")
             if other in d for k in d[other]["programs"]}
    out.update(command=command("cluster.study", argv), grid=args.grid, complete=complete,
               depths=args.depths, memory_fraction=programs.GPU_MEMORY_FRACTION,
               wall_s=time.perf_counter() - tick, published=published_mixtral(),
               programs={k: v for k, v in cache.rows.items() if k in used})
    if args.json:
      stamp(out)
      out["metadata"]["machine"]["device"] = (
          f"{programs.device_text()}; replays and planner times on this host")
      write_result(out, args.json, restamp=False)
    return out

  out = finish(run(args.models, gpus_by_model, args.routings, args.policies, cache, args.grid,
                   args.steps, args.layers, args.hlo_dir,
                   done=lambda partial: finish(partial, False), depths=args.depths,
                   kernels=tuple(args.kernels)), True)
  for r in out["rows"]:
    if "step_s" in r:
      print(f"{r['model']:<14}{r['gpus']:>4} {r['routing']:<17}{r['policy']:<14}"
            f"cf {r['needed_factor']:.3f}->{r['factor']:.3f} step {r['step_s']:.3f} s "
            f"{r['tokens_per_s']:>10,.0f} tok/s  {r['fraction_of_balanced']:.3f} of balanced  "
            f"{r['speedup_over_static'] or 0:.2f}x static, {r['kernels']}"
            + (" (layers {} from {} and {})".format(r["layers"], *r["extrapolated_from"])
               if r.get("extrapolated_from") else ""))
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
