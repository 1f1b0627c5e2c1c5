"""The levers of the one-GPU train step, read in the program XLA:GPU compiles for one
compile-only H200 (no GPU needed; the `gpu-aot` extra): for each shape of
`gpu_train_step.SHAPES` and each of its levers, the train step's schedule estimate by
category (moejax.aot.estimate: within 9% per category and 5% per step of the four measured
H200 kernel tables it was checked on, tests/test_gpu_program_estimate.py) and what the lever
removes from the program:
  - kernels per step;
  - convert bytes inside loop bodies (a weight cast to the compute dtype in every scanned
    layer and every microbatch, a gradient cast back);
  - fp32 [tokens, vocab] buffers (the loss's logits);
  - GEMM FLOPs executed against the model's (remat's recompute, capacity padding, the tiled
    loss's recomputed logits);
  - scatter kernels and the bytes they add atomically;
  - fill bytes inside loop bodies (a stack of layer gradients zero-filled per microbatch);
  - XLA's temporary memory per GPU.
The MoE path and its dense-equivalent are compiled for each lever, so the estimated
MoE / dense-equivalent ratio sits beside the estimated step. The levers that are code, not
bindings (the MoE layer's gather backward, the fused linear cross-entropy, microbatches
accumulated in place rather than through a pipeline of one stage), are priced by
rows with the old path put back for the program (`benchmarks.gpu.before`) at the shape's
microbatches: `BEFORE`; the step they save is that row's less the one without the suffix.
A GPU run measures the same levers (`benchmarks.gpu.on_gpu`, `gpu_train_step.Shape.levers`);
where both exist, the measurement wins.

  python -m benchmarks.gpu.gpu_levers --json benchmarks/gpu/results/gpu_levers_h200.json
  python -m benchmarks.gpu.gpu_levers --shapes gpu_config_ep8_slice --tiny   # the code path
  python -m benchmarks.gpu.gpu_levers --measured benchmarks/gpu/results/on_gpu_h200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time

from benchmarks.common import start

LEVER_BASE = "as configured"
# A compile-only program has XLA's unfused attention (no cuDNN to build the fused kernel
# with), whose [B, H, Q, Q] scores a step without remat keeps for every layer: hundreds of GB
# at 4096 positions, which XLA then rematerialises itself. A GPU run's cuDNN kernel keeps none,
# so only a GPU measures this lever.
NO_REMAT_COMPILE_ONLY = ("compile-only programs keep XLA's unfused attention scores; without "
                         "remat they overflow the GPU and XLA rematerialises on its own: a GPU "
                         "measures this lever")


# (suffix, context that puts the old path back, moe_only): the code levers' "before" rows, each
# beside every lever of the shape's whose bindings change `train.microbatches` (a shape
# without one gets them as configured).
BEFORE = (("scatter backward", "scatter_backward", True),
          ("recompute loss", "recompute_loss", False),
          ("one-stage pipeline", "pipelined_microbatches", False))
# the old path that only differs where the step has microbatches
MICROBATCHED_ONLY = ("pipelined_microbatches",)


def _program_reads(module, vocab: int, d_model: int) -> dict:
  """What the scheduled HLO `module` does in a step, counted over each kernel's runs."""
  from moejax.aot import work
  from moejax.aot.hlo import DTYPE_BYTES
  from moejax.aot.profile import kernels_by_instruction
  out = {"kernels": 0.0, "gemm_flops": 0.0, "attention_flops": 0.0, "loop_convert_bytes": 0.0,
         "scatter_kernels": 0.0, "scatter_bytes": 0.0, "loop_fill_bytes": 0.0,
         "fp32_vocab_buffers": 0, "fp32_vocab_bytes": 0}
  for ins, shapes, runs, done in kernels_by_instruction(module):
    out["kernels"] += runs
    if (attn := work.attention(ins, shapes)) is not None:
      out["attention_flops"] += attn.flops * runs
      continue
    if work.category(module, ins, shapes) == "gemm":
      out["gemm_flops"] += work.flops(module, ins, shapes) * runs
      continue
    kind = work.memory_kind(module, ins)
    moved = work.kernel_bytes(module, ins, shapes, done) * runs
    if kind == "scatter":
      out["scatter_kernels"] += runs
      out["scatter_bytes"] += moved
    if kind == "fill" and runs > 1:     # a zero or constant fill in a loop body
      out["loop_fill_bytes"] += moved
    # a kernel XLA made of a convert (its fusion is named for it), run in a loop body
    if runs > 1 and "convert" in ins.name:
      out["loop_convert_bytes"] += moved
  for comp in module.computations.values():
    for ins in comp:
      for dtype, dims in ins.arrays():
        # positions x vocab (the logits or a tile of them), not [d_model, vocab] weights
        if dtype == "f32" and vocab in dims and math.prod(dims) >= 8 * vocab and not (
            len(dims) == 2 and set(dims) == {vocab, d_model}):
          out["fp32_vocab_buffers"] += 1
          out["fp32_vocab_bytes"] = max(out["fp32_vocab_bytes"],
                                        math.prod(dims) * DTYPE_BYTES["f32"])
  return out


def compile_row(cfg, gpu: str) -> dict:
  """One train step compiled for one compile-only `gpu`: its estimate and reads."""
  from benchmarks.gpu.gpu_train_step import flops_per_token
  from moejax.aot import compile_train_step
  from moejax.aot.estimate import estimate
  from moejax.aot.hlo import parse
  from moejax.aot.summary import peak_bytes
  gp = compile_train_step(cfg, gpu=gpu, topology="1x1x1")
  module = parse(gp.hlo)
  est = estimate(module, gpu, "1x1x1")
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  reads = _program_reads(module, cfg.model.vocab_size, cfg.model.d_model)
  return {"compile_s": round(gp.lower_s + gp.compile_s, 1), "estimated_step_s": est.step_s,
          "estimated_by_category_s": est.by_category, "estimated_kernels": est.kernels,
          "model_flops": flops_per_token(cfg) * tokens,
          "peak_bytes": peak_bytes(gp.memory), "temp_bytes": gp.memory.get("temp", 0),
          **reads}


def shape_rows(shape: str, gpu: str, tiny: bool, levers: list[str] | None) -> list[dict]:
  """The shape's MoE path (its first) and dense-equivalent, as configured and under each
  lever of `gpu_train_step.SHAPES[shape]` (all, or those named in `levers`)."""
  from benchmarks.gpu.gpu_train_step import PATHS, SHAPES, load_config, with_bindings
  spec = SHAPES[shape]
  base = load_config(tiny, 1, shape)
  moe_path = spec.paths[0][0]
  from benchmarks.gpu import before
  variants = [(LEVER_BASE, {}, False, None)] + [(*v, None) for v in spec.levers
                                                if levers is None or v[0] in levers]
  at = [v for v in variants if list(v[1]) == ["train.microbatches"]] or variants[:1]
  for suffix, old, moe_only in BEFORE:
    # the microbatch accumulation's old path also at the shape's own microbatches, where it
    # costs the most
    rows_at = variants[:1] + [v for v in at if v is not variants[0]] if (
        old in MICROBATCHED_ONLY) else at
    for lever, bindings, _, _ in rows_at:
      if old in MICROBATCHED_ONLY and bindings.get("train.microbatches",
                                                   base.train.microbatches) == 1:
        continue
      name = suffix if lever == LEVER_BASE else f"{lever}, {suffix}"
      if levers is None or name in levers:
        variants.append((name, bindings, moe_only, getattr(before, old)))
  rows = []
  for lever, bindings, moe_only, old in variants:
    for path in (moe_path,) if moe_only else (moe_path, "dense_equivalent"):
      row = {"shape": shape, "lever": lever, "path": path, "bindings": bindings}
      if bindings.get("model.remat") is False:
        row["skipped"] = NO_REMAT_COMPILE_ONLY
        rows.append(row)
        continue
      tick = time.perf_counter()
      try:
        cfg = with_bindings(base, {**dict(PATHS)[path], **bindings}).validate()
        if old is not None:
          row["before"] = old.__name__
        with old() if old is not None else contextlib.nullcontext():
          row.update(compile_row(cfg, gpu))
      except Exception as e:    # a lever that does not compile here is a result
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
      row["wall_s"] = round(time.perf_counter() - tick, 1)
      print(f"[levers] {shape} / {lever} / {path}: " + (
          row.get("error") or f"estimated {1e3 * row['estimated_step_s']:.1f} ms, "
                              f"compiled in {row['compile_s']:.0f} s"), flush=True)
      rows.append(row)
  return rows


def savings(rows: list[dict]) -> list[dict]:
  """Per shape, lever and path: the estimated step and each category against the same
  path as configured (positive: saved), and the MoE path's tokens/s over the
  dense-equivalent's under the same lever."""
  base = {(r["shape"], r["path"]): r for r in rows
          if r["lever"] == LEVER_BASE and "error" not in r and "skipped" not in r}
  out = []
  for r in rows:
    b = base.get((r["shape"], r["path"]))
    if "error" in r or "skipped" in r or b is None:
      continue
    dense = next((d for d in rows if d["shape"] == r["shape"] and d["lever"] == r["lever"] and
                  d["path"] == "dense_equivalent" and "error" not in d and
                  "skipped" not in d), None)
    dense = dense or base.get((r["shape"], "dense_equivalent"))
    out.append({"shape": r["shape"], "lever": r["lever"], "path": r["path"],
                "saved_s": b["estimated_step_s"] - r["estimated_step_s"],
                "saved_by_category_s": {k: b["estimated_by_category_s"].get(k, 0.0) - v
                                        for k, v in r["estimated_by_category_s"].items()},
                "moe_over_dense_throughput": (
                    dense["estimated_step_s"] / r["estimated_step_s"]
                    if dense and r["path"] != "dense_equivalent" else None)})
  return out


def measured_run(folder: str) -> dict:
  """What two levers target in a measured run's kernel tables (`on_gpu`'s folder: each shape's
  `kernel_profiles.json.gz` beside its scheduled HLO, `step_hlos.json.gz`), per shape: the
  f32 fills and stack adds of the microbatch accumulation (bytes, the estimate's and the
  measured ms), and the launches inside XLA's command buffers (a kernel run from one is tagged
  with the buffer's op, `command_buffer_N`) beside the step's idle time."""
  import gzip

  from moejax.aot import work
  from moejax.aot.estimate import Rates, kernel
  from moejax.aot.hlo import parse
  from moejax.aot.profile import kernel_name, kernels_by_instruction
  with gzip.open(os.path.join(folder, "kernel_profiles.json.gz")) as f:
    profiles = json.load(f)
  with gzip.open(os.path.join(folder, "step_hlos.json.gz")) as f:
    hlos = json.load(f)
  rates = Rates.for_gpu("h200", "1x1x1")
  out = {}
  for shape, prof in profiles.items():
    module, measured = parse(hlos[shape]), {}
    for name, _, _, us, _ in prof["kernels"]:
      measured[name] = measured.get(name, 0.0) + us * 1e-6
    groups: dict[str, list[float]] = {}
    for ins, shapes, runs, done in kernels_by_instruction(module):
      f32 = bool(ins.arrays()) and all(t == "f32" for t, _ in ins.arrays())
      kind = work.memory_kind(module, ins)
      if kind == "fill":
        group = ("f32 fills a microbatch" if f32 and runs > 1 else
                 "f32 fills of the loop's sums" if f32 and ins.arrays()[0][1][:2] == (1, 1)
                 else "other fills")
      elif f32 and runs > 1 and "transpose(jvp())/while/body/eval_jaxpr/vmap()/add_any" in (
          ins.line):
        group = "stack adds a microbatch"
      else:
        continue
      g = groups.setdefault(group, [0.0, 0.0, 0.0])
      g[0] += work.kernel_bytes(module, ins, shapes, done) * runs
      g[1] += kernel(module, ins, shapes, rates, done).seconds * runs
      g[2] += measured.get(kernel_name(ins.name), 0.0)
    launches = sum(k[4] for k in prof["kernels"])
    inside = sum(k[4] for k in prof["kernels"] if k[1].startswith("command_buffer"))
    out[shape] = {"step_s": prof["span_us_per_step"] * 1e-6,
                  "bytes_estimate_measured": groups, "launches": launches,
                  "in_command_buffers": inside,
                  "idle_s": (prof["span_us_per_step"] - prof["busy_us_per_step"]) * 1e-6}
  return out


def main(argv=None) -> int:
  from benchmarks.gpu.gpu_train_step import SHAPES
  ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_levers",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default=",".join(SHAPES),
                  help=f"comma-separated shapes of gpu_train_step.SHAPES ({', '.join(SHAPES)})")
  ap.add_argument("--levers", default=None,
                  help="comma-separated lever names, a comma and space inside a name "
                       "(default: every lever of each shape)")
  ap.add_argument("--gpu", default="h200", choices=("h100", "h200"))
  ap.add_argument("--tiny", action="store_true", help="tiny models of each shape's kind")
  ap.add_argument("--json", default=None, help="write the rows here")
  ap.add_argument("--measured", default=None, metavar="DIR",
                  help="instead: read a measured run's folder (on_gpu's kernel tables and HLO) "
                       "for the fills and stack adds of the microbatch accumulation and the "
                       "launches inside command buffers; prints, compiles nothing")
  args = ap.parse_args(argv)
  if args.measured:
    print(json.dumps(measured_run(args.measured), indent=1))
    return 0
  os.environ.setdefault("JAX_PLATFORMS", "cpu")   # compile-only: no GPU is started
  from benchmarks.common import command
  from benchmarks.gpu.gpu_program import write
  from moejax.aot.gpus import has_cuda_plugin
  if why := has_cuda_plugin():
    print(f"error: {why}", file=sys.stderr)
    return 2
  # a lever's name may hold ", " (a code lever's row at a binding lever): split on the others
  levers = re.split(r",(?! )", args.levers) if args.levers else None
  rows = []
  for shape in args.shapes.split(","):
    if shape not in SHAPES:
      print(f"error: --shapes names {shape!r}; use some of {', '.join(SHAPES)}",
            file=sys.stderr)
      return 2
    rows += shape_rows(shape, args.gpu, args.tiny, levers)
  result = {"benchmark": "gpu_levers", "gpu": args.gpu, "tiny": args.tiny, "rows": rows,
            "savings": savings(rows)}
  for s in result["savings"]:
    if s["lever"] != LEVER_BASE:
      print(f"{s['shape']:>22} {s['path']:>16} {s['lever']:<48} saves "
            f"{1e3 * s['saved_s']:8.1f} ms" + (
                f", MoE/dense tokens/s {s['moe_over_dense_throughput']:.2f}"
                if s["moe_over_dense_throughput"] else ""))
  if args.json:
    result["metadata"] = {"command": command("gpu.gpu_levers", argv)}
    write(result, args.json, args.gpu)   # the device: the compile-only GPU, not the host's
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
