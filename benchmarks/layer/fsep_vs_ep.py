"""FSEP + planner vs static EP on a skewed routing, each at the capacity that drops nothing.

One MoE layer, forward + backward, on the 8 fake CPU devices as a (1, 8, 1) mesh. The
router is rigged so expert popularity is log-normal (stable across steps, like a trained
gate): token x gets a constant feature that the router maps to log(popularity).

  * ep:   static layout (expert e on device e // (E/N)), capacity factor = the smallest
          one that drops nothing for this routing (computed exactly from the counts).
  * fsep: weights sharded 1/N over all devices, restored every step; layout from the
          `fsep` planner on this routing's counts (C slots per device, replicas of hot
          experts); capacity factor = the smallest that drops nothing under that layout.

Both are timed side by side in interleaved rounds (median ms/iter). On CPU the 8 devices
share the host's cores: the ratio reflects work (capacity rows computed and exchanged,
plus fsep's restore), not network time.

  python -m benchmarks.layer.fsep_vs_ep [--json benchmarks/layer/results/fsep_vs_ep_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import command, start, write_result
from moejax.config import Config, ModelConfig, MoEConfig
from moejax.layout import placement as placement_lib
from moejax.layout.tables import (
  from_placements,
  round_robin_placement,
  static_layout,
  to_placements,
)
from moejax.model.mesh import BATCH_AXES, logical_to_spec, mesh_of_shape
from moejax.model.moe import dispatch
from moejax.model.moe.fsep_experts import FSEP_PARAM_AXES, restore_slot_weights
from moejax.model.moe.layer import EXPERT_PARAM_AXES, ROUTER_AXES, moe_apply
from moejax.model.moe.reference import moe_reference
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


def build(mode, cfg, mesh, layout, params):
  """(jitted fwd + bwd of the layer's loss, its params on the mesh) for expert mode `mode`
  and a one-layer `layout`; `params` in expert order. In ep a slot owns its weights, so slot
  s gets expert `slot_expert[s]`'s; fsep restores them by the same table."""
  rep = NamedSharding(mesh, P())
  row = jax.device_put(jax.tree.map(lambda a: a[0], layout), rep)
  if mode == "ep":
    specs = {k: logical_to_spec(v) for k, v in EXPERT_PARAM_AXES.items()}
    slot_expert = np.asarray(layout.slot_expert_LxS[0])
    p = {k: jax.device_put(np.asarray(params[k])[slot_expert], NamedSharding(mesh, specs[k]))
         for k in specs}
  else:
    specs = {k: logical_to_spec(v[1:]) for k, v in FSEP_PARAM_AXES.items()}
    p = {k: jax.device_put(params[k], NamedSharding(mesh, specs[k])) for k in specs}
  p["router"] = jax.device_put(params["router"], NamedSharding(mesh, logical_to_spec(ROUTER_AXES)))
  slot_expert = jax.device_put(layout.slot_expert_LxS, rep)

  def loss(p, x):
    if mode == "ep":
      slot_p = p
    else:
      w = restore_slot_weights({k: p[k][None] for k in FSEP_PARAM_AXES}, slot_expert, mesh)
      slot_p = {"router": p["router"], **{k: v[0] for k, v in w.items()}}
    y, st = moe_apply(slot_p, x, row, cfg, mesh)
    return _objective(y, st.balance_loss), jnp.sum(st.dropped_W)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)), p


def _objective(y, balance_loss):
  return 0.5 * jnp.mean(y * y) + 0.01 * balance_loss


def expert_order(mode, grads, layout):
  """The layer's parameter gradients in expert order (ep's are per slot)."""
  out = {k: np.asarray(v) for k, v in grads.items()}
  if mode == "ep":
    order = np.argsort(np.asarray(layout.slot_expert_LxS[0]), kind="stable")
    out.update({k: v[order] for k, v in out.items() if k != "router"})
  return out


def check_against_reference(mode, cfg, mesh, layout, params, x):
  """Runs one fwd + bwd of the layer (built as `build` builds it) on `x` with a capacity
  factor at which nothing drops, and compares the loss, the input gradient and every
  parameter gradient with the single-device reference; raises on a difference."""
  slots = layout.slot_expert_LxS.shape[1]
  buffers = slots if cfg.capacity == "slot" else mesh.shape["expert"]     # per source
  dropless = float(buffers)           # every buffer holds all of a source's T x K choices
  fn, dev_params = build(mode, dataclasses.replace(cfg, capacity_factor=dropless), mesh,
                         layout, params)
  x_dev = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
  (loss, dropped), (g_params, g_x) = jax.device_get(fn(dev_params, x_dev))
  if int(dropped):
    raise RuntimeError(f"{mode}: the check dropped {int(dropped)} choices at factor {dropless}")

  def ref_loss(p, x):
    y, _, balance, _ = moe_reference(p, x, cfg.top_k, cfg.normalize_top_k)
    return _objective(y, balance)

  with jax.default_device(jax.devices("cpu")[0]):
    ref, (ref_p, ref_x) = jax.device_get(jax.value_and_grad(ref_loss, argnums=(0, 1))(
        jax.tree.map(jnp.asarray, params), jnp.asarray(x)))
  got = expert_order(mode, g_params, layout)
  pairs = [("loss", loss, ref), ("x", g_x, ref_x)] + [(k, got[k], ref_p[k]) for k in ref_p]
  for name, a, b in pairs:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.abs(b).max()) or 1.0
    if not np.allclose(a, b, rtol=1e-4, atol=1e-5 * scale):
      raise RuntimeError(f"{mode}: {name} differs from the single-device reference by "
                         f"{float(np.abs(a - b).max()):.3g} (scale {scale:.3g})")


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

  x_dev = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
  runs = {}
  for mode, layout, cf in (("ep", ep_layout, ep_cf), ("fsep", fsep_layout, fsep_cf)):
    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, capacity_factor=cf,
                    d_ff=args.d_ff, expert_mode=mode)
    check_against_reference(mode, cfg, mesh, layout, params, x[:n])
    fn, p = build(mode, cfg, mesh, layout, params)
    (_, dropped), _ = jax.block_until_ready(fn(p, x_dev))     # compile + warm-up
    runs[mode] = {"fn": fn, "p": p, "cf": cf, "dropped": int(dropped), "times": []}
  for i in range(args.steps):
    for mode in (("ep", "fsep") if i % 2 == 0 else ("fsep", "ep")):
      r = runs[mode]
      t0 = time.perf_counter()
      jax.block_until_ready(r["fn"](r["p"], x_dev))
      r["times"].append(time.perf_counter() - t0)

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
