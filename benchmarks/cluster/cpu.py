"""The fraction of force-balanced throughput measured, not estimated: on the 8 fake CPU
devices, `benchmarks.layer.balance_pays`'s MoE layer (forward + backward) of each policy at its
capacity factor for <= 1% drops under its skewed routing, over the same layer under uniform
routing at capacity factor 1.0, all timed interleaved in one process.

The uniform routing is forced: the router reads a one-hot feature per token (the layer's
first E features, the rest zero in those rows of the router), so token t picks experts
t mod E and t + 1 mod E, and every source sends every expert exactly its T*K/E choices. Per
policy the uniform layer is the policy's own program (expert mode, capacity mode, its plan
of the uniform counts) at factor 1.0; the force-balanced throughput proper is static EP's
(`uniform/static`), the denominator of the GPU study. On CPU the devices share the host's
cores, so time measures the rows computed and exchanged, not a GPU's speed or a network.

  python -m benchmarks.cluster.cpu [--quick] [--json benchmarks/cluster/results/cluster_cpu.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import command, start, write_result
from benchmarks.layer import balance_pays, balance_setup as setup
from benchmarks.layer.fsep_vs_ep import routed_counts
from moejax.config import MoEConfig
from moejax.model.mesh import BATCH_AXES, mesh_of_shape
from moejax.model.moe.harness import check_against_reference, layer_step, place_sharded

N = balance_pays.N


def uniform_inputs(args, params: dict) -> tuple[np.ndarray, dict]:
  """(x, params with a router that forces uniform routing): token t of a source picks
  experts t mod E and t + 1 mod E, by one-hot features."""
  e, d = args.experts, args.d_model
  if args.top_k != 2 or e + 1 > d or args.tokens_per_device % e:
    raise SystemExit(f"the forced uniform routing needs top_k 2, E < d_model and E dividing "
                     f"the tokens per device (top_k={args.top_k}, E={e}, d_model={d})")
  rng = np.random.default_rng(7)
  x = rng.standard_normal((N * args.tokens_per_device // 128, 128, d)).astype(np.float32)
  t = np.arange(x.shape[0] * x.shape[1]).reshape(x.shape[:2])
  x[..., :e] = 0.0
  np.put_along_axis(x, (t % e)[..., None], 1.0, axis=-1)
  np.put_along_axis(x, ((t + 1) % e)[..., None], 0.5, axis=-1)
  router = np.zeros((d, e), np.float32)
  router[np.arange(e), np.arange(e)] = 8.0
  return x, {**params, "router": router}


def uniform_runs(args, seed: int, mesh) -> dict:
  """Per policy: its layer at capacity factor 1.0 on the forced uniform routing."""
  params, _, _, _ = balance_pays.layer_setup(args, seed)
  x, params = uniform_inputs(args, params)
  counts_WxE = routed_counts(x, params["router"], args.top_k, N)
  share = args.tokens_per_device * args.top_k // args.experts
  if not (counts_WxE == share).all():
    raise RuntimeError(f"the forced routing is not uniform: counts {counts_WxE.min()} to "
                       f"{counts_WxE.max()}, want {share}")
  x_dev = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
  placements = setup.plan(counts_WxE[None].astype(np.float64), N, args.fsep_slots,
                          balance_pays.layer_config(args))
  runs = {}
  for policy in setup.POLICIES:
    p = placements[policy]
    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, capacity_factor=1.0,
                    d_ff=args.d_ff, expert_mode=setup.EXPERT_MODE[policy],
                    capacity=setup.CAPACITY[policy])
    row = jax.tree.map(lambda a: a[0], setup.device_layout(policy, [p], args.experts))
    # One step's outputs and gradients equal the single-device reference's before timing.
    check_against_reference(cfg, mesh, row, params, x[:N])
    fn, fn_args = layer_step(cfg, mesh), place_sharded(params, x_dev, row, mesh,
                                                       cfg.expert_mode)
    (_, (_, stats)), _ = jax.block_until_ready(fn(*fn_args))   # compile + warm-up
    runs[f"uniform/{policy}"] = {"run": lambda fn=fn, a=fn_args: fn(*a),
                                 "capacity_factor": 1.0,
                                 "dropped_fraction": int(np.sum(stats.dropped_W)) /
                                 counts_WxE.sum(),
                                 "tokens": N * args.tokens_per_device}
  return runs


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.cluster.cpu",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="seed 0 only, 4 rounds")
  ap.add_argument("--json", default="benchmarks/cluster/results/cluster_cpu.json")
  ours = ap.parse_known_args(argv)[0]
  args = balance_pays.parse_args(["--no-step"] + (["--quick"] if ours.quick else []))
  mesh = mesh_of_shape((1, N, 1))
  rows, tick = [], time.perf_counter()
  for seed in args.seeds:
    runs = {f"skewed/{k}": v for k, v in balance_pays.layer_runs(args, seed, mesh).items()}
    runs.update(uniform_runs(args, seed, mesh))
    times = balance_pays.time_interleaved(runs, args.rounds)
    tps = {name: r["tokens"] / statistics.median(times[name]) for name, r in runs.items()}
    for policy in setup.POLICIES:
      skewed, uniform = tps[f"skewed/{policy}"], tps[f"uniform/{policy}"]
      rows.append({"policy": policy, "seed": seed,
                   "capacity_factor": runs[f"skewed/{policy}"]["capacity_factor"],
                   "dropped_fraction": runs[f"skewed/{policy}"]["dropped_fraction"],
                   "uniform_dropped_fraction": runs[f"uniform/{policy}"]["dropped_fraction"],
                   "tokens_per_s": skewed, "uniform_tokens_per_s": uniform,
                   "fraction_of_balanced": skewed / tps["uniform/static"],
                   "fraction_of_own_uniform": skewed / uniform,
                   "times_s": times[f"skewed/{policy}"],
                   "uniform_times_s": times[f"uniform/{policy}"]})
      print(f"seed {seed} {policy:<14} cf {rows[-1]['capacity_factor']:.3f} "
            f"{skewed:>9,.0f} tok/s skewed, {uniform:>9,.0f} uniform at cf 1.0: "
            f"{rows[-1]['fraction_of_balanced']:.3f} of force-balanced (static), "
            f"{rows[-1]['fraction_of_own_uniform']:.3f} of its own uniform")
  summary = {p: {"fraction_of_balanced": float(np.exp(np.mean(np.log(
      [r["fraction_of_balanced"] for r in rows if r["policy"] == p])))),
      "fraction_of_own_uniform": float(np.exp(np.mean(np.log(
          [r["fraction_of_own_uniform"] for r in rows if r["policy"] == p]))))}
      for p in setup.POLICIES}
  if ours.json:
    write_result({"rows": rows, "geomean": summary, "args": vars(args),
                  "wall_s": time.perf_counter() - tick, "jax": jax.__version__,
                  "command": command("cluster.cpu", argv)}, ours.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
