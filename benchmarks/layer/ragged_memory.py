"""The ragged path's receive buffer, worst case (factor 0: N x T*K rows) vs bounded (2 x T*K).

For N = 8 and N = 64 expert devices (one subprocess each, with that many fake CPU devices),
one MoE layer's forward + backward through `moejax.model.moe.ragged.ragged_moe`, T = 64
tokens per device, top-2, d_model 128, C = 2 slots per device:

  * cuda_buffer_bytes: lowered for CUDA (jax.export, not compiled: no GPU here), the bytes
    of the forward `ragged_all_to_all`'s receive buffer, read from its result type in the
    lowered module;
  * cpu_temp_bytes: XLA:CPU's compiled memory analysis (temp bytes) of the same layer with
    the collective replaced by its all_to_all emulation (which itself holds N x the send
    rows whatever the factor; the difference between the factors is the buffer's).
The last rows are arithmetic, not measured: the buffer at N = 64, top-8, 8192 tokens per
device, d_model 4096 in bf16.

  python -m benchmarks.layer.ragged_memory [--json benchmarks/layer/results/ragged_memory.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys

from benchmarks.common import start

T, K, D, F, C = 64, 2, 128, 64, 2
FACTORS = (0.0, 2.0)


def _layer(n: int, factor: float, platform: str):
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from moejax.layout import capacity
  from moejax.model.mesh import mesh_of_shape
  from moejax.model.moe import ragged
  from moejax.model.moe.ops import ops_for

  mesh = mesh_of_shape((1, n, 1))
  ops = ops_for("xla", platform)
  rows = capacity.ragged_rows(T, K, n, factor)

  def local(x_TxD, slot_TK, gate_TxK, w_gate, w_up, w_down):
    def loss(x, gate, *w):
      y = ragged.ragged_moe(x, slot_TK, gate, w, ops, n, C, jnp.float32, rows)[0]
      return jnp.sum(y ** 2)
    gx, gg, *gw = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x_TxD, gate_TxK, w_gate, w_up,
                                                          w_down)
    return gx, gg, *gw

  spec = P("expert")
  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec,) * 5))
  s = jax.ShapeDtypeStruct
  args = (s((n * T, D), jnp.float32), s((n * T * K,), jnp.int32), s((n * T, K), jnp.float32),
          s((n * C, D, F), jnp.float32), s((n * C, D, F), jnp.float32),
          s((n * C, F, D), jnp.float32))
  return fn, args, rows


def child(n: int) -> list[dict]:
  import jax

  from moejax.model.moe import ragged

  out = []
  for factor in FACTORS:
    fn, args, rows = _layer(n, factor, "gpu")
    mlir = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args).mlir_module()
    types = re.findall(r"ragged_all_to_all.*?-> tensor<(\d+)x(\d+)xf32>", mlir)
    buffers = sorted({int(r) for r, d in types if int(d) == D})
    ragged.ragged_all_to_all = ragged.emulated_ragged_all_to_all
    fn_cpu, args_cpu, _ = _layer(n, factor, "cpu")
    temp = fn_cpu.lower(*args_cpu).compile().memory_analysis().temp_size_in_bytes
    ragged.ragged_all_to_all = jax.lax.ragged_all_to_all
    out.append({"devices": n, "factor": factor, "rows": rows,
                "cuda_receive_rows": max(buffers) if buffers else None,
                "cuda_buffer_bytes": (max(buffers) if buffers else 0) * D * 4,
                "cpu_temp_bytes": int(temp)})
  return out


def arithmetic() -> list[dict]:
  n, k, t, d = 64, 8, 8192, 4096
  return [{"devices": n, "factor": f, "top_k": k, "tokens": t, "d_model": d,
           "buffer_gib": (n * t * k if f == 0 else f * t * k) * d * 2 / 2 ** 30,
           "what": "arithmetic (bf16 rows x d_model), not measured"} for f in FACTORS]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.layer.ragged_memory",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--json", default="benchmarks/layer/results/ragged_memory.json")
  ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print(json.dumps(child(args.child)))
    return 0
  rows = []
  for n in (8, 64):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.layer.ragged_memory", "--child",
                           str(n)], env=env, capture_output=True, text=True, check=True)
    rows += json.loads(proc.stdout.strip().splitlines()[-1])
  print(f"{'N':>4}{'factor':>8}{'rows':>8}{'CUDA buffer B':>15}{'CPU temp B':>14}")
  for r in rows:
    print(f"{r['devices']:>4}{r['factor']:>8}{r['rows']:>8}{r['cuda_buffer_bytes']:>15}"
          f"{r['cpu_temp_bytes']:>14}")
  for r in arithmetic():
    print(f"arithmetic: N={r['devices']}, top-{r['top_k']}, {r['tokens']} tokens, d_model "
          f"{r['d_model']}, bf16, factor {r['factor']}: {r['buffer_gib']:.1f} GiB per layer")
  if args.json:
    from benchmarks.common import command, write_result
    write_result({"rows": rows, "arithmetic": arithmetic(),
                  "shapes": {"tokens": T, "top_k": K, "d_model": D, "d_ff": F, "slots": C},
                  "command": command("layer.ragged_memory", argv),
                  "time": datetime.datetime.now(datetime.UTC).isoformat()}, args.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
