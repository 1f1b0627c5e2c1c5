"""The rates a schedule estimate needs, measured on the GPU it runs on: HBM bytes/s of a
streaming elementwise pass, bf16 GEMM FLOP/s at the projection and expert shapes of the
configs people train, and fused (cuDNN) against unfused (XLA) causal attention by head dim,
sequence and heads, forward and forward+backward. On a GPU each time is the GPU kernels' own
(JAX's profiler over repeated calls: `gpu_train_step.kernel_table`): a small kernel ends
before Python dispatches the next, so a wall clock times the dispatch (10 TFLOP/s at
512 x 2048 x 768 on an H200). `benchmarks.gpu.on_gpu` runs it as a step; `python -m
benchmarks.gpu.gpu_rates` runs it alone (tiny sizes on CPU: wall clock, the code path only)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import start

# (m, k, n): tokens x in x out. A square reference; the GPU config's projections and experts;
# Mixtral-8x7B's attention and expert projections at 8K tokens; Qwen3-30B-A3B's at 8K tokens
# (its experts see 8K x 8 / 128 = 512 rows each under balanced routing).
GEMMS = ((8192, 8192, 8192), (8192, 768, 3072), (8192, 768, 1536), (8192, 1536, 768),
         (8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 2048, 4096),
         (512, 2048, 768), (512, 768, 2048), (8192, 2048, 151936))
# (batch, seq, heads, kv_heads, head_dim): the GPU config, Mixtral-8x7B, Qwen3-30B-A3B.
ATTENTION = ((8, 1024, 12, 12, 64), (2, 4096, 32, 8, 128), (2, 4096, 32, 4, 128),
             (1, 8192, 32, 8, 128))
TINY_GEMMS = ((64, 32, 48),)
TINY_ATTENTION = ((1, 64, 4, 2, 16),)


def _median_s(fn, *args, iters: int) -> float:
  """Seconds per call of `fn`: its GPU kernels' time per call on a GPU, else the wall-clock
  median (after one warm-up call either way)."""
  import jax
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    tick = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - tick)
  if jax.devices()[0].platform != "gpu":
    return statistics.median(times)
  import tempfile

  from benchmarks.gpu.gpu_train_step import kernel_table
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
      for _ in range(iters):
        out = fn(*args)
      jax.block_until_ready(out)
    table = kernel_table(logdir, iters)
  return table["kernel_us_per_step"] / 1e6 if "error" not in table else statistics.median(times)


def hbm_rate(elements: int, iters: int) -> dict:
  """Bytes read + written per second of y = 2x over an fp32 array (a streaming pass)."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((elements,), jnp.float32)
  seconds = _median_s(jax.jit(lambda a: a * 2.0), x, iters=iters)
  moved = 2 * 4 * elements
  return {"bytes_moved": moved, "seconds": seconds, "bytes_per_s": moved / seconds}


def gemm_rates(shapes, iters: int) -> list[dict]:
  """bf16 x bf16 -> bf16 matmul FLOP/s (fp32 accumulation, as the model's dots)."""
  import jax
  import jax.numpy as jnp
  rows = []
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
  for m, k, n in shapes:
    ka, kb = jax.random.split(jax.random.key(m + k + n))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.bfloat16)
    seconds = _median_s(dot, a, b, iters=iters)
    rows.append({"m": m, "k": k, "n": n, "seconds": seconds,
                 "flops_per_s": 2 * m * k * n / seconds})
  return rows


def attention_rates(shapes, implementations, iters: int) -> list[dict]:
  """Causal attention forward and forward+backward seconds per implementation; model FLOPs
  count the causal half: forward 2 x 2 x B x H x S^2 x D / 2, backward 2.5x the forward (five
  matmuls of the forward's two, one of them the recomputed scores)."""
  import jax
  import jax.numpy as jnp
  rows = []
  for b, s, h, kv, d in shapes:
    keys = jax.random.split(jax.random.key(s + h + d), 3)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, kv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, kv, d), jnp.bfloat16)
    fwd_flops = 2 * 2 * b * h * s * s * d / 2
    for impl in implementations:
      row = {"batch": b, "seq": s, "heads": h, "kv_heads": kv, "head_dim": d,
             "implementation": impl, "fwd_flops": fwd_flops}
      try:
        def attn(q, k, v, impl=impl):
          return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        fwd = jax.jit(attn)
        both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)),
                                argnums=(0, 1, 2)))
        row["fwd_s"] = _median_s(fwd, q, k, v, iters=iters)
        row["fwd_bwd_s"] = _median_s(both, q, k, v, iters=iters)
        row["fwd_flops_per_s"] = fwd_flops / row["fwd_s"]
        row["fwd_bwd_flops_per_s"] = 3.5 * fwd_flops / row["fwd_bwd_s"]
      except Exception as e:   # cuDNN refusing a shape is a result
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
      rows.append(row)
  return rows


def measure(tiny: bool) -> dict:
  import jax
  on_gpu = jax.devices()[0].platform == "gpu"
  iters = 10 if not tiny else 2
  result = {"device_kind": jax.devices()[0].device_kind,
            "hbm": hbm_rate(2**28 if not tiny else 2**12, iters)}
  result["gemm"] = gemm_rates(TINY_GEMMS if tiny else GEMMS, iters)
  impls = ("cudnn", "xla") if on_gpu else ("xla",)
  result["attention"] = attention_rates(TINY_ATTENTION if tiny else ATTENTION, impls, iters)
  return result


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_rates",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--tiny", action="store_true", help="tiny sizes: the code path, not rates")
  ap.add_argument("--json", help="write the rates here")
  args = ap.parse_args(argv)
  result = measure(args.tiny)
  print(json.dumps(result, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  start()
  raise SystemExit(main())
