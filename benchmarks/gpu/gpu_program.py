"""The GPU program of every strategy family of configs/gpt_moe_gpu.gin, compiled by XLA:GPU
for compile-only H100s (or H200s) on this CPU host, with the XLA flags train.py sets on GPU
(moejax.aot; needs `pip install -e '.[gpu-aot]'`).

Per family and topology one row: XLA's memory per GPU and whether it fits, the collectives
(executions and bytes per step), the async and overlapped shares of their bytes, the
schedule estimate of the step and of its exposed communication (moejax.aot.estimate), the
custom-call kernels, and beside them the arithmetic memory model's and the cost model's
predictions (moejax.strategy). Topologies: '1x1x8' one host of 8 GPUs, '8x1x8' eight hosts;
the global batch is 8 sequences per GPU. `--mixtral` adds configs/mixtral_8x7b.gin at
the strategies `moejax.plan --verify 4` compiles for that many H100s (the h100_ep_node
profile): the plan's top four, the fastest that fits by the schedule estimate its pick.

Run (from the repository root; minutes per row on a 2-core host):
  python -m benchmarks.gpu.gpu_program --topology 1x1x8 \
      --json benchmarks/gpu/results/gpu_program_h100.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time
import traceback

from benchmarks.common import REPO, command, stamp, start, write_result
from benchmarks.gpu import RESULTS
from moejax.aot import compile_train_step
from moejax.aot.gpus import parse_topology
from moejax.aot.summary import summarize
from moejax.aot.verify import fastest
from moejax.config import Config
from moejax.frontend import parse_config
from moejax.runtime.xla_flags import GPU_FLAGS
from moejax.strategy.cost import load_profile, predict_step
from moejax.strategy.offline import best_rows, rank, workload_of
from moejax.strategy.spec import from_config

ROOT = REPO
GPU_GIN = os.path.join(ROOT, "configs", "gpt_moe_gpu.gin")
MIXTRAL_GIN = os.path.join(ROOT, "configs", "mixtral_8x7b.gin")
DENSE = ["moe.dispatch = 'dense'", "moe.kernels = 'xla'"]
# family -> gin bindings on the GPU config (its own: ragged dispatch, Pallas kernels).
FAMILIES = {
    "ep_slot": DENSE,
    "ep_pooled": DENSE + ["moe.capacity = 'device'"],
    "ep_ragged_pallas": [],
    "fsep_planned": DENSE + ["moe.expert_mode = 'fsep'"],
    "fsep_adaptive": DENSE + ["moe.expert_mode = 'fsep'", "moe.fsep_shares = 'adaptive'"],
    "ep_chunks2": DENSE + ["moe.exchange_chunks = 2"],
    "p2_m4": DENSE + ["mesh.stage = 2", "train.microbatches = 4", "mesh.expert = 4"],
    "fsdp": DENSE + ["mesh.fsdp = True", "mesh.expert = 4"],
}
# The fast tests' sizes: the config's choices, a tiny model.
TINY = ["model.vocab_size = 256", "model.d_model = 128", "model.num_layers = 4",
        "model.num_heads = 2", "model.d_ff = 256", "model.max_seq_len = 32",
        "moe.num_experts = 16", "moe.d_ff = 128", "data.seq_len = 32"]
# (Mosaic GPU's grouped matmul needs d_model and moe.d_ff in multiples of 128.)


def family_config(family: str, topology: str, extra: list[str] = (), gin: str = GPU_GIN,
                  ) -> Config:
  slices, hosts, per_host = parse_topology(topology)
  gpus = slices * hosts * per_host
  return parse_config([gin], [f"data.global_batch_size = {8 * gpus}", *FAMILIES[family],
                              *extra])


def model_predictions(cfg: Config, strategy, profile_name: str) -> dict:
  """The arithmetic memory model's peak and the cost model's step (uniform load)."""
  cost = predict_step(strategy, workload_of(cfg), load_profile(profile_name))
  return {"model_memory_bytes": cost.memory_bytes, "model_step_s": cost.total_s,
          "model_profile": profile_name}


def memory_model_error(r: dict) -> float:
  """The memory model's peak over XLA's, less one (positive: the model counts more)."""
  return r["model_memory_bytes"] / r["peak_bytes"] - 1


def write(result: dict, path: str, gpu: str) -> None:
  """`write_result`, the machine named as what compiled the programs (no GPU ran them)."""
  stamp(result)
  result["metadata"]["machine"]["device"] = (
      f"compile-only {gpu.upper()}s (XLA:GPU, jax-cuda12-plugin {_plugin()}) on this CPU host")
  write_result(result, path, restamp=False)


def _plugin() -> str:
  try:
    return importlib.metadata.version("jax-cuda12-plugin")
  except importlib.metadata.PackageNotFoundError:
    return "absent"


def row(cfg: Config, strategy, topology: str, gpu: str, label: str,
        hlo_dir: str | None = None, flags: tuple[str, ...] = GPU_FLAGS) -> dict:
  tick = time.perf_counter()
  profile = "h100_node" if parse_topology(topology)[:2] == (1, 1) else "h100_ep_node"
  try:
    gp = compile_train_step(cfg, strategy, gpu=gpu, topology=topology, flags=flags)
    out = {"family": label, **summarize(gp)}
    if hlo_dir:                     # the scheduled HLO, to read or to re-estimate
      os.makedirs(hlo_dir, exist_ok=True)
      with open(os.path.join(hlo_dir, f"{label}_{topology}.hlo"), "w") as f:
        f.write(gp.hlo)
  except Exception as e:   # noqa: BLE001  (a row says why it did not compile)
    traceback.print_exc()
    spec = strategy.spec if strategy else from_config(cfg, _gpus(topology)).spec
    out = {"family": label, "spec": spec, "topology": topology, "gpu": gpu, "compiled": False,
           "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
  strategy = strategy or from_config(cfg, _gpus(topology))
  out.update(model_predictions(strategy.apply(cfg), strategy, profile))
  if out["compiled"]:
    out["memory_model_error"] = memory_model_error(out)
  out["wall_s"] = round(time.perf_counter() - tick, 1)
  return out


def _gpus(topology: str) -> int:
  slices, hosts, per_host = parse_topology(topology)
  return slices * hosts * per_host


def megatron_mixtral() -> dict:
  """Megatron-Core's published Mixtral-8x7B step on 64 H100s (benchmarks.gpu.published_mixtral)."""
  with open(os.path.join(RESULTS, "published_mixtral.json")) as f:
    published = json.load(f)["published"]
  return {k: published[k] for k in ("step_s", "tflops_per_gpu", "gpus", "layout", "source")}


def mixtral_candidates(cfg: Config, gpus: int, k: int) -> list:
  """The K strategies `python -m moejax.plan --profile h100_ep_node --devices N --verify K`
  compiles: the best under uniform load at <= 1% drops, in the cost model's order."""
  rows = best_rows(rank(cfg, load_profile("h100_ep_node"), gpus), "uniform", 0.01)
  return [r.strategy for r in rows[:k]]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_program",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--topology", nargs="+", default=["1x1x8"])
  parser.add_argument("--gpu", default="h100")
  parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
  parser.add_argument("--tiny", action="store_true", help="the tests' tiny model")
  parser.add_argument("--bindings", nargs="*", default=[], help="more gin bindings")
  parser.add_argument("--mixtral", action="store_true")
  parser.add_argument("--no_families", action="store_true", help="only --mixtral")
  parser.add_argument("--mixtral_candidates", type=int, default=4, metavar="K",
                      help="compile the plan's top K for Mixtral; the fastest that fits is its "
                           "verified pick (moejax.plan --verify K)")
  parser.add_argument("--json", default=None)
  parser.add_argument("--append", action="store_true",
                      help="add the rows to --json's (its earlier runs' provenance kept)")
  parser.add_argument("--hlo_dir", default=None, help="write each program's scheduled HLO here")
  parser.add_argument("--drop_flag", action="append", default=[],
                      help="compile without this GPU flag (its name), to see what it does")
  args = parser.parse_args(argv)
  path = args.json or os.path.join(RESULTS, f"gpu_program_{args.gpu}.json")
  result = {"command": command("gpu.gpu_program", argv), "rows": [], "complete": False,
            "metadata": {"target": f"compile-only {args.gpu} (moejax/aot/targets), topologies "
                                   f"{' '.join(args.topology)}; no GPU used"}}
  if args.append and os.path.exists(path):
    with open(path) as f:
      earlier = json.load(f)
    result["rows"] = earlier.pop("rows")
    result["earlier_runs"] = earlier.pop("earlier_runs", []) + [earlier.get("metadata", {})]
  extra = (TINY if args.tiny else []) + args.bindings
  flags = tuple(f for f in GPU_FLAGS if f.lstrip("-").split("=")[0] not in args.drop_flag)
  result["xla_flags"] = list(flags)
  for topology in args.topology:
    for family in [] if args.no_families else args.families:
      cfg = family_config(family, topology, extra)
      result["rows"].append(row(cfg, None, topology, args.gpu, family, args.hlo_dir, flags))
      result["rows"][-1]["bindings"] = args.bindings
      print({k: v for k, v in result["rows"][-1].items()
             if k not in ("collectives", "kernels", "comm_s_by", "compute_s_by")})
      write(result, path, args.gpu)
    if args.mixtral:
      cfg = parse_config([MIXTRAL_GIN], args.bindings)
      found = []
      for order, strategy in enumerate(mixtral_candidates(cfg, _gpus(topology),
                                                          args.mixtral_candidates)):
        found.append(row(cfg, strategy, topology, args.gpu, "mixtral_8x7b_plan", args.hlo_dir,
                         flags))
        found[-1]["plan_order"] = order       # 0: the cost model's pick
        if _gpus(topology) == 64:       # Megatron-Core's published step on as many H100s
          found[-1]["published"] = megatron_mixtral()
        print({k: v for k, v in found[-1].items() if k in ("spec", "step_s", "peak_bytes")})
      best = fastest(found)
      for f in found:
        f["verified_pick"] = f is best
      result["rows"] += found
      write(result, path, args.gpu)
  result["complete"] = True
  result["load_after"] = os.getloadavg()[0]
  write(result, path, args.gpu)


if __name__ == "__main__":
  start()
  main()
