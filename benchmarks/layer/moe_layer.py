"""Times one MoE layer's forward+backward: the sharded layer against the dense reference.

What it measures: the wall time of one `jax.jit(jax.value_and_grad(loss))` call, with
gradients taken with respect to both the parameters and the input tokens, for

  * `moejax.model.moe.reference.moe_reference` jitted on one device (jax.devices()[0]): every
    token runs through all E experts densely and the top-k outputs are picked;
  * `moejax.model.moe.layer.moe_apply` under `shard_map` on each requested (data, expert, model)
    mesh of 8 devices: route, fixed-capacity dispatch, all_to_all over the expert axis,
    per-slot SwiGLU, all_to_all back, combine.

Both are built by the layer's harness (moejax.model.moe.harness), on its objective.

`main`'s docstring says how.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from benchmarks.common import command, start, write_result
from moejax.config import MoEConfig
from moejax.layout.tables import static_layout
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.harness import (
  init_params,
  interleaved_times,
  layer_step,
  place_sharded,
  reference_step,
)

DEFAULT_JSON = "benchmarks/layer/results/moe_layer_cpu.json"


def parse_mesh(text: str) -> tuple[int, int, int]:
  parts = text.lower().split("x")
  if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise argparse.ArgumentTypeError(f"mesh {text!r} is not DATAxEXPERTxMODEL, e.g. 2x4x1.")
  return tuple(int(p) for p in parts)


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.layer.moe_layer",
                               description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--json", default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})")
  ap.add_argument("--tokens", type=int, default=8192, help="tokens per step = batch * seq_len")
  ap.add_argument("--seq_len", type=int, default=128, help="L; batch B = tokens / L")
  ap.add_argument("--d_model", type=int, default=256)
  ap.add_argument("--d_ff", type=int, default=512, help="hidden size of each expert")
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--top_k", type=int, default=2)
  ap.add_argument("--capacity_factor", type=float, default=1.25)
  ap.add_argument("--steps", type=int, default=10, help="timed iterations per configuration")
  ap.add_argument("--meshes", default="1x8x1,2x4x1,2x2x2",
                  help="comma-separated (data)x(expert)x(model) meshes")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  args.mesh_shapes = [parse_mesh(m) for m in args.meshes.split(",") if m]
  if args.tokens % args.seq_len:
    ap.error(f"--tokens {args.tokens} is not a multiple of --seq_len {args.seq_len}.")
  if args.steps < 1:
    ap.error("--steps must be >= 1.")
  return args


def main(argv=None) -> int:
  """Both get the same parameters and tokens (static layout: slot s hosts expert s). The loss is
  0.5 * mean(y^2) + 0.01 * balance_loss + 1e-3 * z_loss. After a warm-up (compile + one run)
  of every configuration, the configurations are timed in interleaved rounds (one iteration
  each per round, round order rotated) so that noise on a shared machine hits all of them
  alike; each row reports the median per-iteration time. The dropped fraction is
  sum(MoEStats.dropped_W) / (tokens * top_k).

  On a CPU host the 8 devices are faked with --xla_force_host_platform_device_count=8 and
  share the machine's cores, so the ratio to the reference measures the overhead of the
  sharded program (dispatch, collectives, per-device launch) plus its smaller expert FLOP
  count (capacity rows instead of all E experts per token), not a multi-device speed-up.

  Run (from the repository root):

    python -m benchmarks.layer.moe_layer
    python -m benchmarks.layer.moe_layer --tokens 8192 --d_model 256 --d_ff 512 --experts 8 \\
        --top_k 2 --steps 10 --meshes 1x8x1,2x4x1,2x2x2 \\
        --json benchmarks/layer/results/moe_layer_cpu.json
  """
  args = parse_args(argv)
  devices = jax.devices()
  batch = args.tokens // args.seq_len
  cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k,
                  capacity_factor=args.capacity_factor, d_ff=args.d_ff)
  cfg.validate()

  print(f"jax {jax.__version__}, {len(devices)} x {devices[0].platform} "
        f"({devices[0].device_kind}), {os.cpu_count()} host cores")
  if devices[0].platform == "cpu":
    print(f"NOTE: on CPU the {len(devices)} 'devices' share {os.cpu_count()} cores, so the "
          "ratio to the reference measures the sharded program's overhead (and its smaller "
          "capacity-bounded expert FLOPs), not a multi-device speed-up.")

  kp, kx = jax.random.split(jax.random.key(args.seed))
  params_h = jax.device_get(init_params(kp, args.d_model, args.d_ff, args.experts))
  x_h = np.asarray(jax.random.normal(kx, (batch, args.seq_len, args.d_model), jnp.float32))

  # name -> (step fn, args tuple, row metadata)
  configs: dict[str, tuple] = {}
  dev0 = devices[0]
  ref_args = (jax.device_put(params_h, dev0), jax.device_put(x_h, dev0))
  configs["reference"] = (reference_step(cfg), ref_args, {"mesh": "1 device", "kind": "reference"})
  for shape in args.mesh_shapes:
    name = "x".join(map(str, shape))
    if math.prod(shape) > len(devices):
      print(f"skip mesh {name}: needs {math.prod(shape)} devices, have {len(devices)}")
      continue
    if batch % (shape[0] * shape[1]):
      print(f"skip mesh {name}: batch {batch} not divisible by data*expert={shape[0] * shape[1]}")
      continue
    if args.experts % shape[1] or args.d_ff % shape[2]:
      print(f"skip mesh {name}: experts {args.experts} / d_ff {args.d_ff} do not divide "
            f"over expert={shape[1]} / model={shape[2]}")
      continue
    mesh = mesh_of_shape(shape)
    layout_row = jax.tree.map(lambda a: a[0], static_layout(1, args.experts, shape[1]))
    configs[name] = (layer_step(cfg, mesh), place_sharded(params_h, x_h, layout_row, mesh),
                     {"mesh": name, "kind": "sharded"})

  # Warm-up: compile ahead of time, then one untimed run whose outputs give the dropped
  # count and the difference of y from the reference.
  extras: dict[str, dict] = {}
  y_ref = None
  for name, (fn, fargs, meta) in list(configs.items()):
    t0 = time.perf_counter()
    compiled = fn.lower(*fargs).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    (loss, (y, aux)), _ = jax.block_until_ready(compiled(*fargs))
    first_s = time.perf_counter() - t0
    dropped = 0 if name == "reference" else int(np.sum(aux.dropped_W))   # aux: counts, stats
    configs[name] = (compiled, fargs, meta)
    y = np.asarray(y)
    if name == "reference":
      y_ref = y
    extras[name] = {
        "compile_s": compile_s,
        "first_run_s": first_s,
        "loss": float(loss),
        "dropped": int(dropped),
        "max_abs_diff_y_vs_ref": float(np.max(np.abs(y - y_ref))),
    }
    print(f"warmed up {name:>9}: compile {compile_s:5.2f} s, first run {first_s:5.2f} s, "
          f"max|y - y_ref| {extras[name]['max_abs_diff_y_vs_ref']:.2e}")

  # Interleaved timing: each round runs every configuration once, order rotated per round.
  names = list(configs)
  times = interleaved_times({n: configs[n][:2] for n in names}, args.steps)

  cfg_str = (f"T={args.tokens} (B={batch},L={args.seq_len}) D={args.d_model} F={args.d_ff} "
             f"E={args.experts} k={args.top_k} cf={args.capacity_factor}")
  ref_ms = 1e3 * statistics.median(times["reference"])
  rows = []
  for name in names:
    ms = 1e3 * statistics.median(times[name])
    rows.append({
        "config": cfg_str,
        **configs[name][2],
        "ms_per_iter": ms,
        "ms_min": 1e3 * min(times[name]),
        "ms_max": 1e3 * max(times[name]),
        "tokens_per_s": args.tokens / (ms / 1e3),
        "time_ratio_vs_reference": ms / ref_ms,
        "dropped_fraction": extras[name]["dropped"] / (args.tokens * args.top_k),
        **extras[name],
        "iter_ms": [1e3 * t for t in times[name]],
    })

  print(f"\nfwd+bwd, median of {args.steps} interleaved iterations; "
        "ratio = ms / reference ms (>1 = slower)")
  header = f"{'config':<58} {'mesh':>9} {'ms/iter':>9} {'tokens/s':>10} {'ratio':>6} {'dropped':>8}"
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['config']:<58} {r['mesh']:>9} {r['ms_per_iter']:9.1f} {r['tokens_per_s']:10.0f} "
          f"{r['time_ratio_vs_reference']:6.2f} {r['dropped_fraction']:8.2%}")

  out = {
      "benchmark": "moe_layer fwd+bwd (jit(value_and_grad) wrt params and x)",
      "metadata": {
          "jax_version": jax.__version__,
          "jaxlib_version": jaxlib.__version__,
          "platform": devices[0].platform,
          "device_kind": devices[0].device_kind,
          "device_count": len(devices),
          "host_cpu_count": os.cpu_count(),
          "python": platform.python_version(),
          "machine": platform.machine(),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "command": command("layer.moe_layer", argv),
          "timestamp_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "note": ("CPU devices are faked and share the host cores: the ratio measures overhead, "
                   "not speed-up." if devices[0].platform == "cpu" else ""),
      },
      "args": {k: v for k, v in vars(args).items() if k != "mesh_shapes"},
      "rows": rows,
  }
  write_result(out, args.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
