"""Offline GPU compile check: every Pallas kernel's Triton IR, at the GPU config's shapes,
compiled for sm_90a on a host without a GPU; registers and spill bytes per kernel and tiling.

Shapes: configs/gpt_moe_gpu.gin's MoE layer on one device of its mesh (tokens per device =
global batch x sequence / devices, d_model, moe.d_ff, slots per device, the ragged receive
buffer), in bf16, at the config's top_k and at top_k 8. Each kernel (forward and each backward
kernel) is lowered for CUDA alone, its Triton IR (the MLIR bytecode JAX puts in the
`__gpu$xla.gpu.triton` custom call) is printed as text with jaxlib's MLIR, compiled by the
standalone `triton` package (`pip install -e '.[gpu_compile]'`) for compute capability 9.0,
and its PTX is assembled by the ptxas Triton ships, whose `-v` report gives registers and
spill bytes. XLA compiles the same IR with the Triton it bundles, whose version differs, so
the counts are those of this toolchain, not a measurement of XLA's build.

`main`'s docstring says how.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.common import REPO, command, ir_operations, start, write_result
from benchmarks.kernels import RESULTS
from moejax.frontend import parse_config
from moejax.layout import capacity
from pallas_kernels import backend as backend_lib, compat, gather, gmm as gmm_lib
from pallas_kernels.gmm import GmmTuning
from pallas_kernels.permute import PermuteTuning
from pallas_kernels.unpermute import CombineTuning

GPU_GIN = os.path.join(REPO, "configs", "gpt_moe_gpu.gin")
ARCH = 90                   # compute capability of the target; ptxas gets sm_90a
ROW_SWEEP = [dict(block_rows=r, block_d=d, num_warps=w)
             for r in (32, 64) for d in (64, 128, 256) for w in (4, 8)]
GMM_SWEEP = [dict(block_m=m, block_k=k, block_n=n, num_warps=w, num_stages=s)
             for m in (64, 128) for k in (32, 64) for n in (64, 128) for w in (4, 8)
             for s in (2, 3)]


@dataclasses.dataclass(frozen=True)
class Shapes:
  tokens: int               # T per device
  d_model: int              # D
  d_ff: int                 # F per device (moe.d_ff / mesh.model)
  slots: int                # expert slots per device
  rows: int                 # ragged receive-buffer rows
  top_k: int


def config_shapes(top_k: int | None) -> Shapes:
  cfg = parse_config([GPU_GIN], [])
  devices = cfg.mesh.expert * cfg.mesh.model * max(cfg.mesh.data, 1)
  tokens = cfg.data.global_batch_size * cfg.data.seq_len // devices
  k = top_k or cfg.moe.top_k
  return Shapes(tokens, cfg.model.d_model, cfg.moe.d_ff // cfg.mesh.model,
                cfg.moe.num_experts // cfg.mesh.expert, capacity.ragged_rows(
                    tokens, k, cfg.mesh.expert, cfg.moe.ragged_buffer_factor), k)


def _row_kernels(sh: Shapes):
  """(name, fn(tiling) -> (jitted fn, abstract args)) of the gathers, as the layer calls them."""
  s, bf16, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
  t, d, k = sh.tokens, sh.d_model, sh.top_k
  tk = t * k

  def gsum(src_shape, src_dtype, idx_shape, weighted, out_dtype):
    def make(tl):
      kw = dict(out_dtype=out_dtype, block_rows=tl["block_rows"],
                block_d=backend_lib.pow2_tile(d, tl["block_d"]), backend="triton",
                num_warps=tl["num_warps"])
      args = [s(src_shape, src_dtype), s(idx_shape, i32)]
      if weighted:
        return (lambda a, i, w: gather.gather_sum(a, i, w, **kw)), args + [s(idx_shape, f32)]
      return (lambda a, i: gather.gather_sum(a, i, None, **kw)), args
    return make

  def gdot(tl):     # the combine's tuning steps the gather-dot by dot_block_d
    step = min(tl["block_d"], tl.get("dot_block_d", tl["block_d"]))
    kw = dict(block_rows=tl["block_rows"], block_d=backend_lib.pow2_tile(d, step),
              backend="triton", num_warps=tl["num_warps"])
    return (lambda dy, a, i: gather.gather_dot(dy, a, i, **kw)), [
        s((t, d), f32), s((tk, d), bf16), s((t, k), i32)]

  return [
      # permute: x [T, D] -> [T*K, D] (one index column); backward: K columns -> [T, D].
      ("permute_fwd", gsum((t, d), bf16, (tk, 1), False, bf16)),
      ("permute_bwd", gsum((tk, d), bf16, (t, k), False, bf16)),
      # combine: K gated rows -> f32 [T, D]; backward: d rows (one gated column), d gates.
      ("combine_fwd", gsum((tk, d), bf16, (t, k), True, f32)),
      ("combine_bwd_rows", gsum((t, d), f32, (tk, 1), True, bf16)),
      ("combine_bwd_gates", gdot),
  ]


def _gmm_kernels(sh: Shapes):
  s, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
  m, d, f, g = sh.rows, sh.d_model, sh.d_ff, sh.slots

  def tuning(tl):
    return GmmTuning(**tl, backend="triton")

  out = []
  for name, i, o in (("gmm_up", d, f), ("gmm_down", f, d)):
    out += [
        (f"{name}_fwd", lambda tl, i=i, o=o: (
            lambda x, w, n: gmm_lib.gmm_call(x, w, n, tuning(tl), "triton"),
            [s((m, i), bf16), s((g, i, o), bf16), s((g,), i32)])),
        (f"{name}_dx", lambda tl, i=i, o=o: (
            lambda dy, w, n: gmm_lib.gmm_call(dy, w, n, tuning(tl), "triton", True),
            [s((m, o), bf16), s((g, i, o), bf16), s((g,), i32)])),
        (f"{name}_dw", lambda tl, i=i, o=o: (
            lambda x, dy, n: gmm_lib.tgmm_call(x, dy, n, tuning(tl), "triton", jnp.bfloat16),
            [s((m, i), bf16), s((m, o), bf16), s((g,), i32)])),
    ]
  return out


def triton_calls(fn, args) -> list[dict]:
  """The Triton custom calls of fn lowered for CUDA: name, IR bytecode, warps, stages."""
  with compat.cuda_target():
    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir(
        "stablehlo")
  found = []
  for o in ir_operations(module):
    if o.name == "stablehlo.custom_call" and "triton" in str(o.attributes["call_target_name"]):
      cfg = o.attributes["mhlo.backend_config"]
      found.append({"name": str(cfg["name"]).strip('"'), "ir": cfg["ir"].value_bytes,
                    "num_warps": int(str(cfg["num_warps"]).split(":")[0]),
                    "num_stages": int(str(cfg["num_stages"]).split(":")[0])})
  return found


def ir_text(bytecode: bytes) -> str:
  """Triton IR as text: jaxlib's MLIR (with JAX's Triton dialect) reads its own bytecode,
  whose version the standalone Triton's MLIR may not."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect

  ctx = mlir.make_ir_context()
  tt_dialect.register_dialect(ctx)
  with ctx:
    return ir.Module.parse(bytecode).operation.get_asm(enable_debug_info=False)


def compile_sm90a(call: dict, workdir: str) -> dict:
  """Triton IR -> PTX (standalone triton) -> ptxas -v for sm_90a: registers, spill bytes."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia import compiler as nv

  path = os.path.join(workdir, f"{call['name']}.ttir")
  with open(path, "w") as f:
    f.write(ir_text(call["ir"]))
  kernel = triton.compile(path, target=GPUTarget("cuda", ARCH, 32), options={
      "num_warps": call["num_warps"], "num_stages": call["num_stages"]})
  ptx = os.path.join(workdir, f"{call['name']}.ptx")
  with open(ptx, "w") as f:
    f.write(kernel.asm["ptx"])
  ptxas = nv.get_ptxas(ARCH) if "arch" in nv.get_ptxas.__code__.co_varnames else nv.get_ptxas()
  report = subprocess.run([ptxas.path, "-v", f"--gpu-name=sm_{ARCH}a", ptx, "-o",
                           ptx + ".cubin"], capture_output=True, text=True, check=True).stderr
  regs = re.search(r"Used (\d+) registers", report)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
  return {"compiled": True, "registers": int(regs.group(1)),
          "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
          "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))}


def default_tiling(kind: str) -> dict:
  if kind == "gmm":
    t = GmmTuning()
    return dict(block_m=t.block_m, block_k=t.block_k, block_n=t.block_n,
                num_warps=t.num_warps, num_stages=t.num_stages)
  if kind == "permute":
    t = PermuteTuning()
    return dict(block_rows=t.block_rows, block_d=t.block_d, num_warps=t.num_warps)
  t = CombineTuning()
  return dict(block_rows=t.block_rows, block_d=t.block_d, dot_block_d=t.dot_block_d,
              num_warps=t.num_warps)


def rows_for(sh: Shapes, only: str | None, sweep: bool, workdir: str) -> list[dict]:
  kernels = [("permute" if n.startswith("permute") else "combine", n, make)
             for n, make in _row_kernels(sh)] + [("gmm", n, make) for n, make in _gmm_kernels(sh)]
  out = []
  for kind, name, make in kernels:
    if only and only not in name:
      continue
    default = default_tiling(kind)
    tilings = [default] + ([t for t in (GMM_SWEEP if kind == "gmm" else ROW_SWEEP)
                            if t != default] if sweep else [])
    for tiling in tilings:
      row = {"kernel": name, "top_k": sh.top_k, "tiling": tiling, "default": tiling == default}
      try:
        [call] = triton_calls(*make(tiling))
        row.update(compile_sm90a(call, workdir))
      except Exception as e:   # noqa: BLE001  (a tiling that does not compile is a result)
        row.update(compiled=False, registers=None, spill_bytes=None,
                   error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
      out.append(row)
      print(f"{name:20s} k={sh.top_k} {_fmt(tiling):44s} default={row['default']!s:5s} "
            f"compiled={row['compiled']!s:5s} regs={row['registers']} "
            f"spill={row['spill_bytes']} {row.get('error', '')}", flush=True)
  return out


def mosaic_rows(sh: Shapes) -> list[dict]:
  """Mosaic GPU grouped matmul (forward, dx) lowered; not compiled here (see the docstring)."""
  from pallas_kernels import gmm_mosaic
  s, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
  t = GmmTuning(backend="mosaic_gpu")
  tiling = dict(block_m=t.block_m, block_k=t.block_k, block_n=t.block_n,
                max_concurrent_steps=t.max_concurrent_steps, grid_block_n=t.grid_block_n)
  out = []
  for name, i, o, transpose in (("gmm_up_fwd", sh.d_model, sh.d_ff, False),
                                ("gmm_up_dx", sh.d_model, sh.d_ff, True)):
    x = s((sh.rows, o if transpose else i), bf16)
    fn = lambda x, w, n, tr=transpose: gmm_mosaic.ragged_dot(x, w, n, t, tr)
    with compat.cuda_target():
      text = jax.jit(fn).trace(x, s((sh.slots, i, o), bf16), s((sh.slots,), i32)).lower(
          lowering_platforms=("cuda",)).as_text()
    lowered = "mosaic_gpu" in text
    out.append({"kernel": f"mosaic_{name}", "top_k": sh.top_k, "tiling": tiling,
                "default": True, "compiled": False, "registers": None, "spill_bytes": None,
                "lowered": lowered, "error": "not compiled offline: Mosaic GPU modules are "
                "compiled by jaxlib's CUDA plugin when XLA compiles the program"})
  return out


def _fmt(tiling: dict) -> str:
  return " ".join(f"{k.replace('block_', 'b').replace('num_', '')}={v}"
                  for k, v in tiling.items())


def main(argv=None) -> int:
  """The grouped matmul's Mosaic GPU path (Hopper, `backend='mosaic_gpu'`) is lowered too (rows
  with `compiled: false` and the reason): its module is compiled by jaxlib's CUDA plugin when
  XLA compiles the program, which this CPU host cannot load.

  Run (from the repository root):
    python -m benchmarks.kernels.gpu_compile \
        --json benchmarks/kernels/results/gpu_compile_sm90a.json
    python -m benchmarks.kernels.gpu_compile --only gather_dot --top_k 8 --sweep
  """
  ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gpu_compile",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", default=os.path.join(RESULTS, "gpu_compile_sm90a.json"))
  ap.add_argument("--top_k", type=int, action="append",
                  help="top_k values (default: the config's and 8)")
  ap.add_argument("--only", help="kernels whose name contains this")
  ap.add_argument("--sweep", action="store_true", help="also every tiling of the sweep")
  args = ap.parse_args(argv)
  try:
    import triton
  except ImportError:
    print("error: the standalone Triton compiler is not installed; "
          "pip install -e '.[gpu_compile]'", file=sys.stderr)
    return 2
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # Triton 3.9's default, pinned
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    for k in args.top_k or [None, 8]:
      sh = config_shapes(k)
      print(f"# {sh}", flush=True)
      rows += rows_for(sh, args.only, args.sweep, workdir)
      if not args.only:
        rows += mosaic_rows(sh)
  defaults = [r for r in rows if r["default"] and not r["kernel"].startswith("mosaic")]
  summary = {"default_tilings": len(defaults),
             "default_compiled": sum(r["compiled"] for r in defaults),
             "default_spilling": sum(bool(r["spill_bytes"]) for r in defaults)}
  print(summary)
  write_result({"command": command("kernels.gpu_compile", argv), "target": f"sm_{ARCH}a",
                "jax": jax.__version__, "triton": triton.__version__,
                "shapes_from": "configs/gpt_moe_gpu.gin", "summary": summary, "rows": rows},
               args.json)
  return 0 if summary["default_compiled"] == len(defaults) else 1


if __name__ == "__main__":
  start()
  sys.exit(main())
