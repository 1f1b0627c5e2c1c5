"""Loss parity of the one-GPU step's levers that change numerics, on CPU through the trainer:
each lever's loss curve against the same job without it (same seeds, same data), beside the
curve of the baseline at another initialisation seed (train.seed), which says how far two runs
of the baseline that differ only by chance end apart: the noise a lever must stay within.

  - bf16 Adam moments (`optim.moments_dtype`) against fp32, on the default job
    (configs/default.gin, 300 steps) and on the GPU config's miniature;
  - the fused linear cross-entropy (the library's tiled loss: each tile's gradient in the
    forward pass) against the tiled loss that recomputes each tile's logits in its backward
    (`benchmarks.gpu.before.recompute_loss`), on the GPU config's miniature, whose
    `model.loss_chunk` takes the tiled loss; its gradients equal the plain loss's
    (tests/test_loss.py), so what is left is the fp32 summation order compounding over steps.

The GPU config's miniature: configs/gpt_moe_gpu.gin (bf16 compute, remat, the tiled loss, top-2
of experts, GPT-2's 50,304-token vocabulary cut to `MINI_VOCAB`: a head and loss tiles of that
width, though the built-in byte corpus only has ids below 256) at the default job's widths and
mesh, XLA dispatch (the ragged path is GPU-only), the warm-up cut to the run's length.

  python -m benchmarks.gpu.loss_parity --json benchmarks/gpu/results/loss_parity.json
  python -m benchmarks.gpu.loss_parity --steps 5     # the code path
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

from benchmarks.common import start

TAIL = 50             # the curves are compared over their last TAIL steps
MINI_VOCAB = 2048     # of the GPU config's 50,304: a CPU-sized [tokens, vocab] tile
# job: (gin file, bindings, steps): the default job's 300 steps; the miniature's 100, which
# keeps the seven runs near half an hour on a loaded 2-core host
JOBS = {
    "default": ("configs/default.gin", [], 300),
    "gpu_config_mini": ("configs/gpt_moe_gpu.gin", [
        "mesh.host_device_count = 8", "mesh.expert = 4", "mesh.data = -1",
        f"model.vocab_size = {MINI_VOCAB}", "model.d_model = 128", "model.num_layers = 4",
        "model.num_heads = 4", "model.d_ff = 512", "model.max_seq_len = 128",
        "model.loss_chunk = 32", "moe.num_experts = 8", "moe.d_ff = 256",
        "moe.dispatch = 'dense'", "moe.kernels = 'xla'", "data.path = None",
        "data.seq_len = 128", "data.global_batch_size = 16", "optim.warmup_steps = 30"], 100),
}
# (job, run, bindings, `benchmarks.gpu.before` context or None, the run it is compared with)
RUNS = (
    ("default", "fp32 moments", [], None, None),
    ("default", "fp32 moments, train.seed 1", ["train.seed = 1"], None, "fp32 moments"),
    ("default", "bf16 moments", ["optim.moments_dtype = 'bfloat16'"], None, "fp32 moments"),
    ("gpu_config_mini", "fused loss, fp32 moments", [], None, None),
    ("gpu_config_mini", "fused loss, fp32 moments, train.seed 1", ["train.seed = 1"], None,
     "fused loss, fp32 moments"),
    ("gpu_config_mini", "recompute loss, fp32 moments", [], "recompute_loss",
     "fused loss, fp32 moments"),
    ("gpu_config_mini", "fused loss, bf16 moments", ["optim.moments_dtype = 'bfloat16'"], None,
     "fused loss, fp32 moments"),
)


def train_losses(gin: str, bindings: list[str], steps: int, before: str | None) -> list[float]:
  """Each step's loss of a fresh run of `gin` + `bindings` through the trainer (under
  `benchmarks.gpu.before.<before>` when named)."""
  from benchmarks.gpu import before as before_lib
  from moejax.frontend import parse_config
  from moejax.train.trainer import train
  with tempfile.TemporaryDirectory() as tmp:
    cfg = parse_config([gin], [*bindings, f"train.num_steps = {steps}",
                               f"train.run_dir = '{tmp}/run'", "train.eval_every = 1000000",
                               "checkpoint.every = 1000000", "train.progress_bar = False",
                               "train.tensorboard = False"])
    with getattr(before_lib, before)() if before else contextlib.nullcontext():
      train(cfg)
    with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
  return [r["loss"] for r in sorted(records, key=lambda r: r["step"]) if "loss" in r]


def compare(losses: list[float], reference: list[float], tail: int) -> dict:
  """The curve against `reference`'s: the largest per-step difference over the last `tail`
  steps, the difference of their means there and of the final losses."""
  a, b = losses[-tail:], reference[-tail:]
  return {"max_abs_diff_tail": max(abs(x - y) for x, y in zip(a, b)),
          "tail_mean_diff": sum(a) / len(a) - sum(b) / len(b),
          "final_diff": losses[-1] - reference[-1]}


def summarise(rows: list[dict], tail: int) -> list[dict]:
  """Each compared run's differences from its reference, beside those of its job's other-seed
  baseline (the noise), and whether its tail mean is within that noise."""
  by = {(r["job"], r["run"]): r for r in rows}
  out = []
  for r in rows:
    if r["reference"] is None or (r["job"], r["reference"]) not in by:
      continue
    ref = by[(r["job"], r["reference"])]
    diff = compare(r["losses"], ref["losses"], tail)
    noise = next((compare(n["losses"], ref["losses"], tail) for n in rows
                  if n["job"] == r["job"] and n["reference"] == r["reference"]
                  and "train.seed" in n["run"]), None)
    out.append({"job": r["job"], "run": r["run"], "reference": r["reference"],
                "final_loss": r["losses"][-1], "reference_final_loss": ref["losses"][-1],
                **diff, "noise": noise,
                "within_noise": (abs(diff["tail_mean_diff"]) <= abs(noise["tail_mean_diff"])
                                 if noise and "train.seed" not in r["run"] else None)})
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.loss_parity",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=None,
                  help="steps of each run (default: its job's, `JOBS`)")
  ap.add_argument("--runs", default=None, help="semicolon-separated run names (default: all)")
  ap.add_argument("--json", default=None, help="write the rows here")
  args = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")   # CPU runs: no GPU plugin is started
  rows, result = [], {"summary": []}
  for job, run, bindings, before, reference in RUNS:
    if args.runs and run not in args.runs.split(";"):
      continue
    gin, job_bindings, steps = JOBS[job]
    tick = time.perf_counter()
    losses = train_losses(gin, [*job_bindings, *bindings], args.steps or steps, before)
    rows.append({"job": job, "run": run, "bindings": [*job_bindings, *bindings],
                 "before": before, "reference": reference,
                 "steps": len(losses), "wall_s": round(time.perf_counter() - tick, 1),
                 "losses": [round(x, 6) for x in losses]})
    print(f"[parity] {job} / {run}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in "
          f"{rows[-1]['wall_s']:.0f} s", flush=True)
    result = _result(rows, args.json, argv)   # written after each run: a long study keeps
  for s in result["summary"]:                 # what finished
    print(f"{s['job']:>16} {s['run']:<40} final {s['final_loss']:.4f} "
          f"(ref {s['reference_final_loss']:.4f}); last {result['tail']}: max |diff| "
          f"{s['max_abs_diff_tail']:.4f}, mean diff {s['tail_mean_diff']:+.4f}" +
          (f" (seed noise {s['noise']['tail_mean_diff']:+.4f})" if s["noise"] else ""))
  return 0


def _result(rows: list[dict], path: str | None, argv) -> dict:
  from benchmarks.common import command, write_result
  tail = min([TAIL, *(len(r["losses"]) for r in rows)])
  result = {"benchmark": "loss_parity", "tail": tail, "rows": rows,
            "summary": summarise(rows, tail)}
  if path:
    write_result({**result, "metadata": {"command": command("gpu.loss_parity", argv)}}, path)
  return result


if __name__ == "__main__":
  start()
  sys.exit(main())
