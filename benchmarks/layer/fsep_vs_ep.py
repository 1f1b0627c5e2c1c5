"""FSEP + planner vs static EP on a skewed routing, each at the capacity that drops nothing.

One MoE layer, forward + backward, on the 8 fake CPU devices as a (1, 8, 1) mesh. The
router is rigged so expert popularity is log-normal (stable across steps, like a trained
gate): token x gets a constant feature that the router maps to log(popularity).

  * ep:   static layout (expert e on device e // (E/N)), capacity factor = the smallest
          one that drops nothing for this routing (computed exactly from the counts).
  * fsep: weights sharded 1/N over all devices, restored every step; layout from the
          `fsep` planner on this routing's counts (C slots per device, replicas of hot
          experts); capacity factor = the smallest that drops nothing under that layout.

Both are built, checked against the single-device reference (at a factor that drops
nothing) and timed side by side in interleaved rounds (median ms/iter) by the layer's harness
(moejax.model.moe.harness). On CPU the 8 devices share the host's cores: the ratio reflects
work (capacity rows computed and exchanged, plus fsep's restore), not network time.

  python -m benchmarks.layer.fsep_vs_ep [--json benchmarks/layer/results/fsep_vs_ep_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import jax
import numpy as np

from benchmarks.common import command, start, write_result
from moejax.config import Config, ModelConfig, MoEConfig
from moejax.layout import host_layout as placement_lib
from moejax.layout.tables import (
  from_placements,
  round_robin_placement,
  static_layout,
  to_placements,
)
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe import dispatch
from moejax.model.moe.harness import (
  check_against_reference,
  interleaved_times,
  layer_step,
  place_sharded,
)
from moejax.placement.policies import get_policy
from moejax.strategy.placement_cost import of_config


def parse_args(argv):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.layer.fsep_vs_ep",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--top_k", type=int, default=2)
  ap.add_argument("--d_model", type=int, default=256)
  ap.add_argument("--d_ff", type=int, default=512)
  ap.add_argument("--tokens_per_device", type=int, default=2048)
  ap.add_argument("--fsep_slots", type=int, default=4, help="C for fsep (ep uses E/N)")
  ap.add_argument("--sigma", type=float, default=1.0, help="log-normal popularity skew")
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", default="benchmarks/layer/results/fsep_vs_ep_cpu.json")
  return ap.parse_args(argv)


def skewed_inputs(args, n):
  rng = np.random.default_rng(args.seed)
  d, e = args.d_model, args.experts
  log_pop = args.sigma * rng.standard_normal(e)
  x = rng.standard_normal((n * args.tokens_per_device // 128, 128, d)).astype(np.float32)
  x[..., 0] = 4.0                                     # the constant routing feature
  router = 0.05 * rng.standard_normal((d, e)).astype(np.float32)
  router[0] = log_pop / 4.0
  params = {"router": router,
            "w_gate": rng.standard_normal((e, d, args.d_ff)).astype(np.float32) / d ** 0.5,
            "w_up": rng.standard_normal((e, d, args.d_ff)).astype(np.float32) / d ** 0.5,
            "w_down": rng.standard_normal((e, args.d_ff, d)).astype(np.float32) / args.d_ff ** 0.5}
  return x, params


def routed_counts(x, router, top_k, n):
  """[sources, E] (token, k) counts of the rigged router, as the layer will see them."""
  logits = np.einsum("bld,de->ble", x, router).reshape(n, -1, router.shape[1])
  top = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k]
  return np.stack([np.bincount(t.reshape(-1), minlength=router.shape[1]) for t in top])


def needed_capacity_factor(slot_counts_WxS, tokens, top_k):
  """Smallest capacity factor with capacity(tokens, k, slots, cf) >= every pair's load."""
  num_slots = slot_counts_WxS.shape[1]
  cf = slot_counts_WxS.max() * num_slots / (tokens * top_k)
  while dispatch.capacity(tokens, top_k, num_slots, cf) < slot_counts_WxS.max():
    cf *= 1.0001
  return float(cf)


def main(argv=None) -> int:
  args = parse_args(argv)
  n = 8
  mesh = mesh_of_shape((1, n, 1))
  x, params = skewed_inputs(args, n)
  counts = routed_counts(x, params["router"], args.top_k, n)
  tokens = args.tokens_per_device
  load = counts.sum(0)
  print(f"routing: E={args.experts} top-{args.top_k}, hottest expert "
        f"{load.max() / load.sum():.1%} of choices, max/mean expert load "
        f"{load.max() / load.mean():.2f}")

  ep_layout = static_layout(1, args.experts, n)
  ep_cf = needed_capacity_factor(counts[:, np.asarray(ep_layout.slot_expert_LxS[0])], tokens,
                                 args.top_k)
  start = round_robin_placement(args.experts, n, args.fsep_slots)
  cost = of_config(Config(model=ModelConfig(d_model=args.d_model),
                          moe=MoEConfig(d_ff=args.d_ff)))
  t0 = time.perf_counter()
  plan = get_policy("fsep")(counts.astype(float), start, slots=args.fsep_slots,
                            src_dev_W=np.arange(n), cost=cost, num_devices=n)
  plan_ms = (time.perf_counter() - t0) * 1e3
  fsep_layout = from_placements([plan], args.experts, n)
  # The device sees the shares rounded to parts of 1024: use the layout's own placement.
  fsep_loads = placement_lib.split_loads(to_placements(fsep_layout, n)[0], counts)
  fsep_cf = needed_capacity_factor(fsep_loads, tokens, args.top_k)

  runs = {}
  for mode, layout, cf in (("ep", ep_layout, ep_cf), ("fsep", fsep_layout, fsep_cf)):
    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, capacity_factor=cf,
                    d_ff=args.d_ff, expert_mode=mode)
    layout_row = jax.tree.map(lambda a: a[0], layout)
    check_against_reference(cfg, mesh, layout_row, params, x[:n])
    call = (layer_step(cfg, mesh), place_sharded(params, x, layout_row, mesh, mode))
    (_, (_, stats)), _ = jax.block_until_ready(call[0](*call[1]))     # compile + warm-up
    runs[mode] = {"call": call, "cf": cf, "dropped": int(np.sum(stats.dropped_W))}
  times = interleaved_times({mode: r["call"] for mode, r in runs.items()}, args.steps)
  for mode, r in runs.items():
    r["times"] = times[mode]

  rows = []
  print(f"{'mode':<6} {'capacity factor':>15} {'dropped':>8} {'ms/iter':>9} {'tokens/s':>10}")
  for mode, r in runs.items():
    ms = statistics.median(r["times"]) * 1e3
    tps = n * tokens / (ms / 1e3)
    rows.append({"mode": mode, "capacity_factor": r["cf"], "dropped": r["dropped"],
                 "ms_per_iter": ms, "tokens_per_s": tps, "times_s": r["times"]})
    print(f"{mode:<6} {r['cf']:>15.3f} {r['dropped']:>8} {ms:>9.1f} {tps:>10.0f}")
  ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
  print(f"fsep / ep tokens/s = {ratio:.2f}x  (fsep planner: {plan_ms:.2f} ms, replicas per "
        f"expert {np.bincount(plan.slot_expert, minlength=args.experts).tolist()})")
  if args.json:
    write_result({"rows": rows, "ratio": ratio, "planner_ms": plan_ms, "args": vars(args),
                  "devices": [str(d) for d in jax.devices()[:n]], "jax": jax.__version__,
                  "command": command("layer.fsep_vs_ep", argv),
                  "time": datetime.datetime.now(datetime.UTC).isoformat()}, args.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
