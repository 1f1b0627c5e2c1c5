"""Pallas dispatch kernels and the MoE layer with each `moe.kernels` / `moe.dispatch` option.

Part 1, kernel tile sweeps (each kernel against its plain-jnp reference; max_err = max
|kernel - reference| of the forward): permute and unpermute-combine report GB/s (rows read +
written once), the grouped matmul TFLOP/s (2*M*I*O per matmul; fwd+bwd counts 3 matmuls).
Part 2, the sharded MoE layer's jit(value_and_grad) time (wrt params and tokens) per option,
median of interleaved iterations, and max |y - y(dense, xla)|.

On CPU the kernels run in Pallas INTERPRET mode and the 8 "devices" are faked on the host's
cores: those numbers time the interpreter, say nothing about kernel speed, and are recorded
only as a smoke run; `ragged` is skipped there (XLA:CPU has no ragged_all_to_all). On a GPU
host the kernels are compiled with the Triton backend, in bf16, over a tile sweep.

Run (from the repository root):
  python -m benchmarks.kernels.kernels   # -> kernels/results/kernels_{gpu,cpu_interpret}.json
  python -m benchmarks.kernels.kernels --only gmm --skip_layer --json /tmp/k.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.common import command, start, write_result
from moejax.config import MoEConfig
from moejax.layout.tables import static_layout
from moejax.model.mesh import AXES
from moejax.model.moe.harness import init_params, place_sharded
from moejax.model.moe.layer import moe_apply
from pallas_kernels import backend as backend_lib, grouped_matmul, permute, unpermute

KERNELS = ("permute", "unpermute_combine", "gmm")
KERNEL_COLUMNS = ["kernel", "dtype", "block_rows", "block_d", "block_m", "block_k", "block_n",
                  "max_err", "fwd_ms", "fwd_GBps", "fwd_TFLOPs", "fwd_bwd_ms", "fwd_bwd_TFLOPs"]


def _row_record(kernel: str, fwd, bwd, args: tuple, ref, moved: int, tuning, iters: int,
                **shape) -> dict:
  """One tuning of a row-moving kernel: its error against `ref`, fwd and fwd+bwd times, and
  the GB/s of the `moved` bytes."""
  err = timing.max_abs_diff(fwd(*args), ref)
  s_fwd = timing.median_seconds(fwd, *args, iters=iters)
  s_bwd = timing.median_seconds(bwd, *args, iters=iters)
  return {"kernel": kernel, **shape, "block_rows": tuning.block_rows,
          "block_d": backend_lib.pow2_tile(shape["D"], tuning.block_d), "max_err": err,
          "fwd_ms": 1e3 * s_fwd, "fwd_GBps": moved / s_fwd / 1e9, "fwd_bwd_ms": 1e3 * s_bwd}


def permute_sweep(num_tokens: int, d: int, top_k: int, tunings, dtype=jnp.float32,
                  iters: int = 5, seed: int = 0) -> list[dict]:
  """Time `permute` (fwd, and fwd+bwd) on a random dispatch: every token copied top_k times
  in shuffled order. GB/s counts the rows read and written once each."""
  rng = np.random.default_rng(seed)
  rows = num_tokens * top_k
  token_rows = jnp.asarray(rng.permutation(np.repeat(np.arange(num_tokens), top_k)), jnp.int32)
  x = jnp.asarray(rng.standard_normal((num_tokens, d)), dtype)
  rows_TxK = permute.invert(token_rows, num_tokens, top_k)
  ref = permute.permute_reference(x, token_rows)
  moved = 2 * rows * d * jnp.dtype(dtype).itemsize
  out = []
  for tuning in tunings:
    fwd = jax.jit(lambda x, t=tuning: permute.permute(x, token_rows, rows_TxK, t))
    bwd = jax.jit(jax.grad(lambda x, t=tuning: jnp.sum(
        permute.permute(x, token_rows, rows_TxK, t) ** 2)))
    out.append(_row_record("permute", fwd, bwd, (x,), ref, moved, tuning, iters,
                           T=num_tokens, D=d, K=top_k, dtype=jnp.dtype(dtype).name))
  return out


def combine_sweep(num_tokens: int, d: int, top_k: int, tunings, dtype=jnp.float32,
                  iters: int = 5, seed: int = 0) -> list[dict]:
  """Time unpermute_combine (fwd, and fwd+bwd wrt rows and gates) on a random dispatch.
  GB/s counts T*K rows read and T rows written once each."""
  rng = np.random.default_rng(seed)
  rows = num_tokens * top_k
  row_TxK = jnp.asarray(rng.permutation(rows).reshape(num_tokens, top_k), jnp.int32)
  src = jnp.asarray(rng.standard_normal((rows, d)), dtype)
  gate = jnp.asarray(rng.random((num_tokens, top_k)), jnp.float32)
  ref = unpermute.unpermute_combine_reference(src, row_TxK, gate)
  moved = (rows + num_tokens) * d * jnp.dtype(dtype).itemsize
  combine = unpermute.unpermute_combine
  out = []
  for tuning in tunings:
    fwd = jax.jit(lambda s, g, t=tuning: combine(s, row_TxK, g, t))
    bwd = jax.jit(jax.grad(lambda s, g, t=tuning: jnp.sum(combine(s, row_TxK, g, t) ** 2),
                           argnums=(0, 1)))
    out.append(_row_record("unpermute_combine", fwd, bwd, (src, gate), ref, moved, tuning,
                           iters, T=num_tokens, D=d, K=top_k, dtype=jnp.dtype(dtype).name))
  return out


def random_sizes(rng, m: int, groups: int, fill: float = 1.0) -> np.ndarray:
  """Uneven group sizes (some empty) summing to round(fill * m)."""
  total = int(round(fill * m))
  cuts = np.sort(rng.integers(0, total + 1, groups - 1))
  return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def gmm_sweep(m: int, i: int, o: int, groups: int, tunings, dtype=jnp.float32, iters: int = 5,
              seed: int = 0) -> list[dict]:
  """Time gmm fwd and fwd+bwd on uneven random groups; TFLOP/s = 2*M*I*O per matmul."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, i)) / np.sqrt(i), dtype)
  w = jnp.asarray(rng.standard_normal((groups, i, o)), dtype)
  sizes_np = random_sizes(rng, m, groups)
  sizes = jnp.asarray(sizes_np)
  bounds = np.concatenate([[0], np.cumsum(sizes_np)])   # host-known: static per-group slices
  ref = jnp.concatenate([jnp.dot(x[a:b], w[g], preferred_element_type=jnp.float32)
                         for g, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
                        + [jnp.zeros((m - bounds[-1], o), jnp.float32)])
  flops = 2.0 * m * i * o
  gmm = grouped_matmul.gmm
  out = []
  for tuning in tunings:
    fwd = jax.jit(lambda x, w, t=tuning: gmm(x, w, sizes, t))
    bwd = jax.jit(jax.grad(lambda x, w, t=tuning: jnp.sum(gmm(x, w, sizes, t).astype(
        jnp.float32) ** 2), argnums=(0, 1)))
    err = timing.max_abs_diff(fwd(x, w), ref)
    s_fwd = timing.median_seconds(fwd, x, w, iters=iters)
    s_bwd = timing.median_seconds(bwd, x, w, iters=iters)
    out.append({"kernel": "gmm", "M": m, "I": i, "O": o, "G": groups,
                "dtype": jnp.dtype(dtype).name, "block_m": tuning.block_m,
                "block_k": tuning.block_k, "block_n": tuning.block_n, "max_err": err,
                "fwd_ms": 1e3 * s_fwd, "fwd_TFLOPs": flops / s_fwd / 1e12,
                "fwd_bwd_ms": 1e3 * s_bwd, "fwd_bwd_TFLOPs": 3 * flops / s_bwd / 1e12})
  return out


def kernel_sweeps(gpu: bool, iters: int, only=KERNELS) -> list[dict]:
  """The tile sweep of each kernel in `only`: bf16 at MoE-layer sizes on a GPU, a small f32
  smoke run of two tiles on CPU (interpret mode)."""
  if gpu:
    t, d, f, e, dtype = 16384, 2048, 1536, 8, jnp.bfloat16
    gather_tiles = [(br, bd) for br in (16, 32, 64, 128) for bd in (64, 128, 256, 512)]
    gmm_tunings = [grouped_matmul.GmmTuning(block_m=bm, block_k=bk, block_n=bn, num_warps=w,
                                            num_stages=s)
                   for bm in (64, 128) for bk in (32, 64) for bn in (64, 128)
                   for w, s in ((4, 2), (8, 3))]
  else:
    t, d, f, e, dtype = 256, 128, 128, 4, jnp.float32
    gather_tiles = [(32, 64), (64, 128)]
    gmm_tunings = [grouped_matmul.GmmTuning(32, 32, 32), grouped_matmul.GmmTuning(64, 64, 64)]
  rows = []
  if "permute" in only:
    rows += permute_sweep(t, d, 2, [permute.PermuteTuning(*bt) for bt in gather_tiles], dtype,
                          iters)
  if "unpermute_combine" in only:
    rows += combine_sweep(t, d, 2, [unpermute.CombineTuning(*bt) for bt in gather_tiles],
                          dtype, iters)
  if "gmm" in only:
    rows += gmm_sweep(2 * t, d, f, e, gmm_tunings, dtype, iters)
  return rows


def layer_times(gpu: bool, iters: int) -> list[dict]:
  devices = jax.devices()
  n = len(devices)
  tokens, seq, d, f, experts = (65536, 1024, 1024, 2048, 4 * n) if gpu else (2048, 64, 64, 128, 8)
  options = [("dense", "xla"), ("dense", "pallas")]
  options += [("ragged", "xla"), ("ragged", "pallas")] if gpu else []
  mesh = jax.make_mesh((1, n, 1), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)
  kp, kx = jax.random.split(jax.random.key(0))
  params_h = jax.device_get(init_params(kp, d, f, experts))
  x_h = np.asarray(jax.random.normal(kx, (tokens // seq, seq, d), jnp.float32))
  layout = jax.tree.map(lambda a: a[0], static_layout(1, experts, n))
  dtype = jnp.bfloat16 if gpu else jnp.float32
  steps, ys = {}, {}
  for dispatch, kernels in options:
    cfg = MoEConfig(num_experts=experts, top_k=2, capacity_factor=1.25, d_ff=f,
                    dispatch=dispatch, kernels=kernels)

    def loss(p, x, lay, cfg=cfg):
      y, st = moe_apply(p, x, lay, cfg, mesh, dtype)
      return 0.5 * jnp.mean(jnp.square(y.astype(jnp.float32))), (y, jnp.sum(st.dropped_W))

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True, argnums=(0, 1)))
    args = place_sharded(params_h, x_h, layout, mesh)
    t0 = time.perf_counter()
    (_, (y, dropped)), _ = jax.block_until_ready(fn(*args))
    steps[(dispatch, kernels)] = (fn, args, time.perf_counter() - t0, int(dropped))
    ys[(dispatch, kernels)] = np.asarray(y, np.float32)
  times = {k: [] for k in steps}
  for i in range(iters):                    # interleaved, order rotated per round
    keys = list(steps)
    for k in keys[i % len(keys):] + keys[:i % len(keys)]:
      fn, args, _, _ = steps[k]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[k].append(time.perf_counter() - t0)
  base = ys[("dense", "xla")]
  return [{"kernel": "moe_layer", "dispatch": dsp, "kernels": krn, "mesh": f"1x{n}x1",
           "tokens": tokens, "D": d, "F": f, "E": experts, "dtype": jnp.dtype(dtype).name,
           "first_call_s": steps[(dsp, krn)][2],
           "fwd_bwd_ms": 1e3 * statistics.median(times[(dsp, krn)]),
           "dropped_fraction": steps[(dsp, krn)][3] / (2 * tokens),
           "max_diff_vs_dense_xla": float(np.max(np.abs(ys[(dsp, krn)] - base)))}
          for dsp, krn in steps]


def main(argv=None) -> int:
  dev = jax.devices()[0]
  gpu = dev.platform == "gpu"
  ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.kernels",
                               description=__doc__.split("\n\n")[0])
  suffix = "" if gpu else "_interpret"
  ap.add_argument("--json",
                  default=f"benchmarks/kernels/results/kernels_{dev.platform}{suffix}.json")
  ap.add_argument("--iters", type=int, default=10 if gpu else 3)
  ap.add_argument("--only", choices=KERNELS, action="append",
                  help="sweep only this kernel (repeatable); default: all")
  ap.add_argument("--skip_layer", action="store_true", help="kernel sweeps only")
  args = ap.parse_args(argv)

  note = timing.platform_note()
  print(note)
  kernels = kernel_sweeps(gpu, args.iters, args.only or KERNELS)
  timing.print_table(kernels, KERNEL_COLUMNS)
  layer = [] if args.skip_layer else layer_times(gpu, args.iters)
  if layer:
    print()
    timing.print_table(layer, ["dispatch", "kernels", "mesh", "tokens", "D", "F", "E", "dtype",
                               "fwd_bwd_ms", "dropped_fraction", "max_diff_vs_dense_xla"])
  out = {
      "benchmark": "pallas dispatch kernels (sweeps) and MoE layer fwd+bwd per option",
      "metadata": {
          "note": note, "jax_version": jax.__version__, "platform": dev.platform,
          "device_kind": dev.device_kind, "device_count": len(jax.devices()),
          "host_cpu_count": os.cpu_count(), "python": platform.python_version(),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "command": command("kernels.kernels", argv),
          "timestamp_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      },
      "kernels": kernels, "layer": layer,
  }
  write_result(out, args.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
