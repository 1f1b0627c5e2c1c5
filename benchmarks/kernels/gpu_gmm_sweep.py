"""The grouped matmuls of the MoE layer on one GPU, beside XLA's dense dot of the same FLOPs.

For the expert up-projection of three models (the gate's is the same; the down-projection's
passes are these shapes with the weight the other way round), each of its three matmuls:
  fwd  x @ w[g]                [rows, d] x [C, d, f]    -> [rows, f]
  dx   dy @ w[g]^T             [rows, f] x [C, d, f]^T  -> [rows, d]
  dw   x[g]^T @ dy[g]          [rows, d] x [rows, f]    -> [C, d, f]
is timed for every candidate kernel and tiling: this package's Hopper kernels (gmm_hopper),
JAX's Mosaic GPU ragged dot as the layer calls it today (gmm_mosaic), the Triton kernels,
`jax.lax.ragged_dot` and its transposes, and XLA's dense dot of the same FLOPs.
Shapes (bf16, one microbatch of 2 x 4096 tokens, groups near-balanced with +-20% noise):
  mixtral     8 groups of ~2048 rows, d 4096, f 14336 (top-2 of 8192 tokens)
  qwen3       128 groups of ~512 rows, d 2048, f 768 (top-8 of 8192 tokens)
  gpu_config  32 groups of ~512 rows, d 768, f 1536 (configs/gpt_moe_gpu.gin, top-2)
Each candidate runs inside one jit as a `lax.fori_loop` of calls (inputs through an
optimization barrier, so that no call is hoisted or merged), timed at 1 and R calls: the time
per call is the difference over R - 1, free of dispatch. Its output is checked against
`jax.lax.ragged_dot` (or its transpose): max |got - want| / max |want|. Candidates are built
in parallel batches and run in priority order (the references and the layer's current
kernels first) until the budget is spent; the JSON is rewritten after every row.

  python -m benchmarks.kernels.gpu_gmm_sweep   # benchmarks/kernels/results/gpu_gmm_sweep_<gpu>.json
  python -m benchmarks.kernels.gpu_gmm_sweep --tiny --json /tmp/gmm_tiny.json   # CPU: the code path
  JAX_PLATFORMS=cpu python -m benchmarks.kernels.gpu_gmm_sweep --compile_only h100  # what builds
`--tiny`: tiny shapes on CPU, the kernels interpreted (gmm_hopper's on jax >= 0.11): its
times measure nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import command, stamp, start, write_result
from benchmarks.kernels import RESULTS
from pallas_kernels import compat, gmm_hopper, gmm_mosaic
from pallas_kernels.gmm import GmmTuning, gmm_call, tgmm_call

TOL = 2e-2            # bf16 outputs (8 bits of mantissa) of float32 sums, relative to max|want|
MIN_LOOP_S = 0.02     # each timed loop runs at least this long on the device
SLOW_CALL_S = 0.25    # a call this slow is timed at 2 calls, once


class Shape(NamedTuple):
  rows: int
  groups: int
  d: int
  f: int


SHAPES = {"mixtral": Shape(16384, 8, 4096, 14336), "qwen3": Shape(65536, 128, 2048, 768),
          "gpu_config": Shape(16384, 32, 768, 1536)}
TINY_SHAPES = {"tiny": Shape(200, 4, 128, 256)}
PASSES = ("fwd", "dx", "dw")


@dataclasses.dataclass(frozen=True)
class Candidate:
  impl: str             # xla_dense | xla_ragged_dot | hopper | jax_mosaic | triton | jax_mosaic_t
  params: dict
  priority: int         # lower runs first: 0 the references and today's layer path


def hopper(split, bm, bn, steps, priority=2, **extra):
  return Candidate("hopper", dict(split=split, block_m=bm, block_n=bn, block_k=64,
                                  max_concurrent_steps=steps, **extra), priority)


def candidates(pass_: str, tiny: bool) -> list[Candidate]:
  """What is timed for one pass, highest priority first (ties keep this order)."""
  refs = [Candidate("xla_dense", {}, 0), Candidate("xla_ragged_dot", {}, 0)]
  today = dataclasses.asdict(gmm_mosaic.hopper_tuning(GmmTuning(backend="mosaic_gpu")))
  if tiny:
    interp = compat.mosaic_gpu_interpret() is not None
    small = [Candidate("triton", dict(block_m=16, block_k=64, block_n=64), 0)]
    if interp and pass_ != "dw":
      small += [hopper("n", 64, 64, 2), hopper("m", 64, 64, 2)]
    if interp and pass_ == "dw":
      small += [Candidate("hopper", dict(block_m=64, block_n=64, block_k=32,
                                         max_concurrent_steps=2), 2)]
    return refs + small
  triton_today = {k: today[k] for k in ("block_m", "block_k", "block_n", "num_warps",
                                        "num_stages")}
  if pass_ == "dw":       # today: Triton's tgmm at the layer's Hopper tiles
    return refs + [
        Candidate("triton", triton_today, 0),
        Candidate("hopper", dict(block_m=128, block_n=128, block_k=64,
                                 max_concurrent_steps=4), 2),
        # JAX's Mosaic GPU kernel on the transposed problem: its forward reached 0.91 of the
        # dense dot on an H200 where Triton's tgmm reached 0.42, so it is timed first, and
        # before this package's Hopper kernels, whose device fault would end the sweep
        Candidate("jax_mosaic_t", dict(block_m=128, block_n=128, block_k=64,
                                       max_concurrent_steps=4, grid_block_n=1), 1),
        Candidate("hopper", dict(block_m=128, block_n=128, block_k=128,
                                 max_concurrent_steps=2), 3),
        Candidate("triton", dict(block_m=64, block_k=128, block_n=128, num_warps=8,
                                 num_stages=3), 3)]
  keep = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
  # hopper: a CTA of 128 x 256 (split n) or 256 x 128 (split m), 4 steps in flight, each SM's
  # tiles chained; then the same unchained (what chaining is worth), 128 x 256 as two 64-row
  # halves, and 64 x 256 (fewer rows wasted where a tile straddles two groups).
  return refs + [
      Candidate("jax_mosaic", {k: today[k] for k in keep}, 0),
      hopper("n", 128, 128, 4), hopper("m", 128, 128, 4),
      hopper("n", 128, 128, 4, priority=3, chain=False), hopper("m", 64, 256, 4, priority=3),
      hopper("n", 64, 128, 4, priority=3),
      Candidate("triton", dict(block_m=128, block_k=64, block_n=256, num_warps=8,
                               num_stages=3), 3)]


def group_sizes(rng, shape: Shape) -> np.ndarray:
  """Near-balanced routing: each group's share of the rows varies by +-20%."""
  share = 1 + 0.2 * rng.uniform(-1, 1, shape.groups)
  sizes = np.floor(share / share.sum() * shape.rows).astype(np.int32)
  sizes[0] += shape.rows - sizes.sum()
  return sizes


def operands(pass_: str, shape: Shape, sizes, seed: int = 0) -> tuple:
  """fwd: x [m, d], w [C, d, f]; dx: dy [m, f], w; dw: x, dy [m, f]; outputs of O(1)."""
  m, d, f, c = shape.rows, shape.d, shape.f, shape.groups
  a, b, fan_in = {"fwd": ((m, d), (c, d, f), d), "dx": ((m, f), (c, d, f), f),
                  "dw": ((m, d), (m, f), m)}[pass_]
  k1, k2 = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(k1, a, jnp.bfloat16),
          (jax.random.normal(k2, b, jnp.float32) / fan_in ** 0.5).astype(jnp.bfloat16),
          jnp.asarray(sizes))


def _dense(pass_: str):
  """XLA's dense dot of the same FLOPs (the first group's weight for every row)."""
  dims = {"fwd": (((1,), (0,)), ((), ())), "dx": (((1,), (1,)), ((), ())),
          "dw": (((0,), (0,)), ((), ()))}[pass_]
  return lambda a, b, _: lax.dot_general(a, b if pass_ == "dw" else b[0], dims,
                                         preferred_element_type=jnp.float32).astype(a.dtype)


def _ragged(pass_: str):
  """`jax.lax.ragged_dot` and its transposes, as jax.grad would differentiate it."""
  if pass_ == "fwd":
    return lambda x, w, s: lax.ragged_dot(x, w, s)
  if pass_ == "dx":
    return lambda dy, w, s: jax.linear_transpose(
        lambda x: lax.ragged_dot(x, w, s),
        jax.ShapeDtypeStruct((dy.shape[0], w.shape[1]), dy.dtype))(dy)[0]
  return lambda x, dy, s: jax.linear_transpose(
      lambda w: lax.ragged_dot(x, w, s),
      jax.ShapeDtypeStruct((s.shape[0], x.shape[1], dy.shape[1]), x.dtype))(dy)[0]


def kernel_fn(cand: Candidate, pass_: str, tiny: bool, num_sms: int):
  """(a, b, sizes) -> the pass's output, for one candidate."""
  p, tr = cand.params, pass_ == "dx"
  interp = compat.mosaic_gpu_interpret() if tiny else None
  if cand.impl == "xla_dense":
    return _dense(pass_)
  if cand.impl == "xla_ragged_dot":
    return _ragged(pass_)
  if cand.impl == "hopper" and pass_ == "dw":
    return lambda x, dy, s: gmm_hopper.tgmm(x, dy, s, num_sms=num_sms, interpret=interp, **p)
  if cand.impl == "hopper":   # dx: w [C, d, f] read as [C, out=d, in=f] transposed
    return lambda a, w, s: gmm_hopper.gmm(a, w, s, transpose_rhs=tr, num_sms=num_sms,
                                          interpret=interp, **p)
  if cand.impl == "jax_mosaic":
    tuning = GmmTuning(backend="mosaic_gpu", **p)
    return lambda a, w, s: gmm_mosaic.ragged_dot(a, w, s, tuning, transpose_rhs=tr)
  if cand.impl == "jax_mosaic_t":
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as t
    return lambda x, dy, s: t.transposed_ragged_dot(x, dy, group_sizes=s, **p)
  backend = "interpret" if tiny else "triton"
  tuning = GmmTuning(backend=backend, **p)
  if pass_ == "dw":
    return lambda x, dy, s: tgmm_call(x, dy, s, tuning, backend, x.dtype)
  return lambda a, w, s: gmm_call(a, w, s, tuning, backend, transpose_rhs=tr)


def looped(fn):
  """jit(reps, a, b, sizes) -> fn's output after `reps` calls in one fori_loop; each call
  reads its operands through an optimization barrier tied to the loop index."""
  @jax.jit
  def run(reps, a, b, sizes):
    out = jax.eval_shape(fn, a, b, sizes)

    def body(i, _):
      a_, b_, s_, _ = lax.optimization_barrier((a, b, sizes, i))
      return fn(a_, b_, s_)
    return lax.fori_loop(0, reps, body, jnp.zeros(out.shape, out.dtype))
  return run


def _seconds(run, reps, args, repeats: int = 3) -> float:
  times = []
  for _ in range(repeats):
    tick = time.perf_counter()
    jax.block_until_ready(run(reps, *args))
    times.append(time.perf_counter() - tick)
  return statistics.median(times)


def build(cand: Candidate, pass_: str, shape: Shape, tiny: bool, num_sms: int,
          sharding=None):
  """The candidate's timed loop, compiled (for `sharding`'s device; default JAX's):
  (executable, seconds) or (None, why it does not build)."""
  structs = jax.eval_shape(functools.partial(operands, pass_, shape,
                                             np.ones(shape.groups, np.int32)))
  args = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for v in structs]
  tick = time.perf_counter()
  try:
    exe = looped(kernel_fn(cand, pass_, tiny, num_sms)).lower(
        jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding), *args).compile()
  except Exception as e:   # noqa: BLE001  (a tiling that does not fit is a row, not a stop)
    return None, _why(e)
  return exe, time.perf_counter() - tick


def build_all(jobs: list[tuple], threads: int) -> list[tuple]:
  """`build` of each job, `threads` at a time (XLA's compiles, Mosaic GPU's and Triton's
  included, run outside Python's lock; the GPU stays idle but for XLA's autotuning)."""
  if threads <= 1:
    return [build(*job) for job in jobs]
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return list(pool.map(lambda job: build(*job), jobs))


def timed(run, args, want, tiny: bool) -> tuple[dict, jax.Array]:
  """Check `run`'s output against `want`; its time per call (the difference of R calls and
  one, over R - 1)."""
  got = run(jnp.int32(1), *args)
  err = None if want is None else (float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
                                   / max(float(jnp.max(jnp.abs(want))), 1e-30))
  slow = tiny                    # interpreted: a code path, timed once
  one = _seconds(run, jnp.int32(1), args, repeats=1 if slow else 3)
  slow = slow or one > SLOW_CALL_S   # e.g. a ragged_dot that XLA runs as a dense dot per group
  reps = 2 if slow else int(np.clip(MIN_LOOP_S / max(one, 1e-6), 4, 50))
  many = _seconds(run, jnp.int32(reps), args, repeats=1 if slow else 3)
  per_call = (many - one) / (reps - 1) if many > one else many / reps
  return {"ms": 1e3 * per_call, "reps": reps, "one_call_ms": 1e3 * one, "rel_err": err,
          "ok": None if err is None else bool(err <= TOL)}, got


def device_usable() -> bool:
  """Whether the device still runs a trivial computation after a candidate's error."""
  try:
    jax.device_get(jnp.ones((1,)) + 1)
    return True
  except Exception:   # noqa: BLE001  (any failure here means the context is gone)
    return False


def _why(e: Exception) -> str:
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def _row(name: str, pass_: str, shape: Shape, cand: Candidate) -> dict:
  return {"shape": name, "pass": pass_, "rows": shape.rows, "groups": shape.groups,
          "d": shape.d, "f": shape.f, "impl": cand.impl, "params": cand.params}


def sweep(shapes: dict, tiny: bool, budget_s: float, num_sms: int, write, impls=None,
          threads: int = 1) -> list[dict]:
  """Every (shape, pass): its candidates (of `impls`, default all) in priority order, built
  `threads` at a time, then run one by one; no new batch starts once `budget_s` is spent."""
  start, rows, rng = time.perf_counter(), [], np.random.default_rng(0)
  sizes = {name: group_sizes(rng, s) for name, s in shapes.items()}
  work = [(c.priority, i, name, pass_, c) for name in shapes for pass_ in PASSES
          for i, c in enumerate(candidates(pass_, tiny)) if impls is None or c.impl in impls]
  work.sort(key=lambda w: (w[0], list(shapes).index(w[2]), PASSES.index(w[3]), w[1]))
  # Batches never mix priorities: the references run before what is checked against them.
  batches = [[w for w in work if w[0] == p][i:i + threads]
             for p in sorted({w[0] for w in work})
             for i in range(0, sum(w[0] == p for w in work), threads)]
  refs, dense, inputs = {}, {}, {}
  # A kernel that faults on the device (CUDA_ERROR_MISALIGNED_ADDRESS, say) leaves the CUDA
  # context unusable: every later call in this process fails with the same error, which
  # would be read as each candidate's own. An error that leaves it usable (out of memory,
  # too many resources for a launch) stops only its own candidate.
  fault = None
  for batch in batches:
    if fault is not None:
      rows += [{**_row(n, p, shapes[n], c), "skipped": f"not run: {fault}"}
               for _, _, n, p, c in batch]
      continue
    if time.perf_counter() - start > budget_s:
      rows += [{**_row(n, p, shapes[n], c), "skipped": f"budget of {budget_s:.0f} s spent"}
               for _, _, n, p, c in batch]
      continue
    built = build_all([(c, p, shapes[n], tiny, num_sms) for _, _, n, p, c in batch], threads)
    for (_, _, name, pass_, cand), (run, compile_s) in zip(batch, built, strict=True):
      shape = shapes[name]
      row = _row(name, pass_, shape, cand)
      if fault is not None:
        rows.append({**row, "skipped": f"not run: {fault}"})
        continue
      if run is None:
        rows.append({**row, "error": compile_s})
        write(rows)
        continue
      if (name, pass_) not in inputs:
        inputs[(name, pass_)] = operands(pass_, shape, sizes[name])
      write(rows + [{**row, "running": "a run cut off here stopped in this candidate"}])
      try:
        result, got = timed(run, inputs[(name, pass_)], refs.get((name, pass_)), tiny)
      except Exception as e:   # noqa: BLE001  (a kernel that fails is a row, not a stop)
        rows.append({**row, "error": _why(e)})
        write(rows)
        if not device_usable():
          fault = (f"{name} {pass_} {cand.impl} {cand.params} faulted on the device before it "
                   "and left the CUDA context unusable")
        continue
      if cand.impl == "xla_ragged_dot":
        refs[(name, pass_)] = got.astype(jnp.float32)
        result["rel_err"], result["ok"] = 0.0, True
      flops = 2.0 * shape.rows * shape.d * shape.f
      row.update(result, compile_s=compile_s, tflops=flops / (result["ms"] * 1e-3) / 1e12)
      if cand.impl == "xla_dense":
        dense[(name, pass_)] = result["ms"]
        row.pop("rel_err"), row.pop("ok")
      if (name, pass_) in dense:
        row["of_dense"] = dense[(name, pass_)] / result["ms"]
      rows.append(row)
      write(rows)
  return rows


def compile_check(shapes: dict, gpu: str, impls=None, threads: int = 1) -> list[dict]:
  """Every candidate's timed loop compiled for a compile-only `gpu` ('h100', 'h200'; no GPU
  here, nothing runs): its compile time, or why it does not build (e.g. SMEM it lacks)."""
  from moejax.aot.gpus import compile_only_devices
  device = compile_only_devices(gpu, "1x1x1")[0]
  num_sms = compat.num_sms(device) or 132
  sharding = jax.sharding.SingleDeviceSharding(device)
  jobs = [(name, pass_, cand) for name in shapes for pass_ in PASSES
          for cand in candidates(pass_, False) if impls is None or cand.impl in impls]
  with compat.cuda_target(device.device_kind):   # Triton asks jax's GPU table for the kind
    built = build_all([(c, p, shapes[n], False, num_sms, sharding) for n, p, c in jobs],
                      threads)
  rows = [{"shape": n, "pass": p, "impl": c.impl, "params": c.params,
           ("error" if exe is None else "compile_s"): info}
          for (n, p, c), (exe, info) in zip(jobs, built, strict=True)]
  print(*rows, sep="\n")
  return rows


def best(rows: list[dict]) -> list[dict]:
  """Per (shape, pass): the fastest correct grouped matmul beside the dense dot."""
  out = []
  for key in dict.fromkeys((r["shape"], r["pass"]) for r in rows):
    ok = [r for r in rows if (r["shape"], r["pass"]) == key and r.get("ok")
          and r["impl"] not in ("xla_dense",)]
    if ok:
      top = min(ok, key=lambda r: r["ms"])
      out.append({k: top.get(k) for k in ("shape", "pass", "impl", "params", "ms", "tflops",
                                          "of_dense")})
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gpu_gmm_sweep",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", help="default: benchmarks/kernels/results/gpu_gmm_sweep_<gpu>.json")
  ap.add_argument("--tiny", action="store_true", help="CPU, interpreted kernels, tiny shapes")
  ap.add_argument("--budget_s", type=float, default=75.0,
                  help="start no batch after this many seconds (one may run past it)")
  ap.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
  ap.add_argument("--impls", default=None, help="comma-separated subset of the candidates' "
                  "impl names (xla_dense, xla_ragged_dot, hopper, jax_mosaic, jax_mosaic_t, "
                  "triton); the first two are the references")
  ap.add_argument("--compile_threads", type=int, default=8,
                  help="candidates built at once, then timed one by one (--tiny: 1)")
  ap.add_argument("--compile_only", choices=("h100", "h200"), default=None,
                  help="no GPU: compile every candidate for a compile-only GPU of this kind "
                  "and report what builds (JAX_PLATFORMS=cpu and the gpu_aot extra)")
  args = ap.parse_args(argv)
  impls = set(args.impls.split(",")) | {"xla_dense", "xla_ragged_dot"} if args.impls else None
  shapes = TINY_SHAPES if args.tiny else {
      k: SHAPES[k] for k in (args.shapes.split(",") if args.shapes else SHAPES)}
  if args.compile_only:
    rows = compile_check(shapes, args.compile_only, impls, args.compile_threads)
    bad = [r for r in rows if "error" in r]
    print(f"{len(rows) - len(bad)} of {len(rows)} candidates build for a compile-only "
          f"{args.compile_only.upper()}")
    return 0
  dev = jax.devices()[0]
  if not args.tiny and dev.platform != "gpu":
    print("benchmarks.kernels.gpu_gmm_sweep times GPU kernels; this host has none (--tiny runs the "
          "code path on CPU).")
    return 1
  num_sms = 2 if args.tiny else compat.num_sms(dev) or 132   # interpreted: 2 "SMs"
  kind = "cpu" if args.tiny else dev.device_kind.split()[1].lower()
  path = args.json or f"{RESULTS}/gpu_gmm_sweep_{kind}.json"
  note = "interpreted: times measure nothing" if args.tiny else f"{num_sms} SMs"
  result = stamp({"benchmark": "grouped matmuls vs XLA's dense dot, fwd / dx / dw",
                  "metadata": {"command": command("kernels.gpu_gmm_sweep", argv),
                               "note": f"jax {jax.__version__} on {dev.device_kind}; {note}"}})

  def write(rows):        # after every row, so that a run cut off keeps what it measured
    result.update(rows=rows, best=best(rows))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
      json.dump(result, f, indent=2)

  rows = sweep(shapes, args.tiny, float("inf") if args.tiny else args.budget_s, num_sms, write,
               impls, 1 if args.tiny else args.compile_threads)
  result.update(rows=rows, best=best(rows))
  write_result(result, path)
  for r in result["best"]:
    print(f"{r['shape']:>10} {r['pass']:>3}: {r['impl']:<14} {r['ms']:.3f} ms "
          f"{r['tflops']:.0f} TF/s, {r.get('of_dense') or 0:.2f} of dense  {r['params']}")
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
