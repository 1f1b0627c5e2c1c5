"""Grouped-matmul tilings on a GPU: JAX's Mosaic GPU ragged dot (Hopper) and our Triton gmm
against XLA's `jax.lax.ragged_dot` and a dense dot of the same size, bf16, at the MoE layer's
shapes ([131072, 1024] x [4, 1024, 2048], its transpose-sized twin, and the GPU config's
[16384, 768] x [32, 768, 1536]); uneven random groups. Each variant: max |out - ragged_dot|,
median of 10 timed calls after one warm-up, TFLOP/s = 2*M*K*N / time. GPU only.

  python -m benchmarks.kernels.gmm_tiles [--json benchmarks/kernels/results/gmm_tiles_h100.json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.common import command, start, write_result
from benchmarks.kernels import RESULTS
from pallas_kernels import gmm_mosaic, grouped_matmul
from pallas_kernels.gmm import GmmTuning

SHAPES = [(131072, 1024, 2048, 4), (131072, 2048, 1024, 4), (16384, 768, 1536, 32)]
MOSAIC = list(itertools.product((64, 128), (128, 256), (64,), (2, 4), (1, 2, 4)))
TRITON = [(64, 64, 128, 4, 2), (128, 64, 128, 8, 3), (128, 64, 256, 8, 3), (128, 32, 128, 8, 4)]


def _row(base, impl, seconds, flops, **extra) -> dict:
  return {**base, "impl": impl, **extra, "ms": 1e3 * seconds, "TFLOPs": flops / seconds / 1e12}


def shape_rows(m: int, k: int, n: int, g: int, rng) -> list[dict]:
  x = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
  cuts = np.sort(rng.integers(0, m, g - 1))
  sizes = jnp.asarray(np.diff(np.r_[0, cuts, m]), jnp.int32)
  flops, base = 2.0 * m * k * n, {"M": m, "K": k, "N": n, "G": g}
  ref = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, sizes))
  want = ref(x, w)
  rows = [_row(base, "xla ragged_dot", timing.median_seconds(ref, x, w, iters=10), flops),
          _row(base, "xla dense dot (one group)",
               timing.median_seconds(jax.jit(lambda x, w: x @ w[0]), x, w, iters=10), flops)]
  for bm, bn, bk, steps, grid in MOSAIC:
    if n % (bn * grid):
      continue
    tu = GmmTuning(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps,
                   grid_block_n=grid, backend="mosaic_gpu")
    fn = jax.jit(lambda x, w, tu=tu: gmm_mosaic.ragged_dot(x, w, sizes, tu))
    rows.append(_row(base, "mosaic", timing.median_seconds(fn, x, w, iters=10), flops, bm=bm,
                     bn=bn, bk=bk, mcs=steps, gbn=grid,
                     max_err=timing.max_abs_diff(fn(x, w), want)))
  for bm, bk, bn, warps, stages in TRITON:
    tu = GmmTuning(block_m=bm, block_k=bk, block_n=bn, num_warps=warps, num_stages=stages,
                   backend="triton")
    fn = jax.jit(lambda x, w, tu=tu: grouped_matmul.gmm(x, w, sizes, tu))
    rows.append(_row(base, "triton", timing.median_seconds(fn, x, w, iters=10), flops, bm=bm,
                     bk=bk, bn=bn, warps=warps, stages=stages,
                     max_err=timing.max_abs_diff(fn(x, w), want)))
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gmm_tiles",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", default=os.path.join(RESULTS, "gmm_tiles_h100.json"))
  args = ap.parse_args(argv)
  if jax.devices()[0].platform != "gpu":
    print("benchmarks.kernels.gmm_tiles times compiled GPU kernels; this host has no GPU.")
    return 1
  rng, rows = np.random.default_rng(0), []
  for shape in SHAPES:
    rows += shape_rows(*shape, rng)
  best = sorted(rows, key=lambda r: (r["M"], r["K"], r["ms"]))
  timing.print_table(best, ["M", "K", "N", "G", "impl", "bm", "bn", "bk", "mcs", "gbn", "warps",
                            "stages", "ms", "TFLOPs", "max_err"])
  write_result({"benchmark": "grouped-matmul tilings (Mosaic GPU, Triton) vs XLA",
                "metadata": {"note": timing.platform_note(),
                             "command": command("kernels.gmm_tiles", argv)},
                "rows": rows}, args.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
