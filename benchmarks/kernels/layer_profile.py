"""Where a GPU spends the MoE layer's time: forward and forward+backward medians of the layer
(`moe_apply`, bf16, 65536 tokens, d_model 1024, d_ff 2048, 4 experts on a (1, N, 1) mesh of
the host's GPUs) per `dispatch:kernels` option, and per option the GPU kernels of two
profiled forward+backward calls (JAX's profiler, its Perfetto trace) summed by name, per call.
XLA_FLAGS is the caller's: run it once per flag set to compare them. GPU only.

  XLA_FLAGS=... python -m benchmarks.kernels.layer_profile --tag default ragged:pallas dense:xla
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.common import command, start, write_result
from benchmarks.kernels import RESULTS
from moejax.config import MoEConfig
from moejax.layout.tables import static_layout
from moejax.model.mesh import AXES
from moejax.model.moe.harness import init_params, place_sharded
from moejax.model.moe.layer import moe_apply

TOKENS, SEQ, D, F, EXPERTS = 65536, 1024, 1024, 2048, 4


def gpu_kernels(trace_dir: str, calls: int) -> collections.Counter:
  """ms per call of each GPU kernel name in the Perfetto trace under `trace_dir`."""
  files = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)
  if not files:
    return collections.Counter()
  with gzip.open(files[0]) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
         and "gpu" in e["args"]["name"].lower()}
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu:
      total[e["name"][:90]] += e.get("dur", 0) / 1e3 / calls
  return total


def profile(option: str, mesh, params_h, x_h, layout) -> dict:
  dispatch, kernels = option.split(":")
  cfg = MoEConfig(num_experts=EXPERTS, top_k=2, capacity_factor=1.25, d_ff=F,
                  dispatch=dispatch, kernels=kernels)

  def loss(p, x, lay):
    y, _ = moe_apply(p, x, lay, cfg, mesh, jnp.bfloat16)
    return 0.5 * jnp.mean(jnp.square(y.astype(jnp.float32)))

  fwd, both = jax.jit(loss), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  args = place_sharded(params_h, x_h, layout, mesh)
  out = {"option": option, "fwd_ms": 1e3 * timing.median_seconds(fwd, *args),
         "fwd_bwd_ms": 1e3 * timing.median_seconds(both, *args)}
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(2):
        jax.block_until_ready(both(*args))
    kernels_ms = gpu_kernels(trace_dir, calls=2)
  out["gpu_ms_per_fwd_bwd"] = sum(kernels_ms.values())
  out["top_kernels_ms"] = [[name, ms] for name, ms in kernels_ms.most_common(25)]
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.layer_profile",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("options", nargs="+", help="dispatch:kernels, e.g. ragged:pallas dense:xla")
  ap.add_argument("--tag", default="default", help="names the JSON: layer_profile_<tag>.json")
  args = ap.parse_args(argv)
  devices = jax.devices()
  if devices[0].platform != "gpu":
    print("benchmarks.kernels.layer_profile profiles GPU kernels; this host has no GPU.")
    return 1
  mesh = jax.make_mesh((1, len(devices), 1), AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  kp, kx = jax.random.split(jax.random.key(0))
  params_h = jax.device_get(init_params(kp, D, F, EXPERTS))
  x_h = np.asarray(jax.random.normal(kx, (TOKENS // SEQ, SEQ, D), jnp.float32))
  layout = jax.tree.map(lambda a: a[0], static_layout(1, EXPERTS, len(devices)))
  rows = []
  for option in args.options:
    rows.append(profile(option, mesh, params_h, x_h, layout))
    print(f"{option}: fwd {rows[-1]['fwd_ms']:.2f} ms, fwd+bwd {rows[-1]['fwd_bwd_ms']:.2f} ms")
    for name, ms in rows[-1]["top_kernels_ms"][:12]:
      print(f"  {ms:9.3f} ms  {name}")
  write_result({"benchmark": "MoE layer GPU kernel profile",
                "metadata": {"note": timing.platform_note(),
                             "xla_flags": os.environ.get("XLA_FLAGS", ""),
                             "command": command("kernels.layer_profile", argv)},
                "rows": rows}, os.path.join(RESULTS, f"layer_profile_{args.tag}.json"))
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
