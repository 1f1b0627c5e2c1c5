"""The GPU cost model against a published figure: Mixtral-8x7B on 64 H100s (Megatron-Core).

Published (NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md): "468 TFLOPS for
Mixtral 8X7B bf16 training" with MCore v0.9, and as its reference mapping 64 H100 80GB
(8 per node, NVLink 4, InfiniBand 8 x 400 Gbit/s), dropless all-to-all dispatch, BF16,
sequence 4096, TP 1, EP 8, PP 4 (virtual 8), micro-batch 1, global batch 256. The README's
mapping table is labelled MCore v0.8; we take it as the layout of the 468 figure.

Megatron counts model FLOPs per token as 12 L d^2 [(1 + g/h + s/d) + (F/d) K 3/2] + 6 d V
(g/h = 8/32 query groups per head, s the sequence, F the expert width, K = 2, V the
vocab), so 468 TFLOP/s per GPU is a step time of 256 x 4096 tokens x that / (64 x 468e12).

moejax's prediction (`moejax.strategy.cost.predict_step`, what `python -m moejax.plan`
ranks by) for configs/mixtral_8x7b.gin at the same shape and GPU count: moejax has no
pipeline axis, so the layout is data 8 x expert 8: each GPU then runs 4 sequences through
all 32 layers where under PP 4 x DP 16 it runs 16 sequences through 8 layers, the same FLOPs
per GPU; ragged (dropless) dispatch, even expert load. Two profiles: `h100_cluster`
(the expert all_to_all crosses nodes) and `h100_ep_node` (the expert axis inside one node's
NVLink, the data axis over InfiniBand), the published layout's placement of EP 8.

  python -m benchmarks.published_mixtral [--json PATH]
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import RESULTS, command, write_result
from moejax.frontend import parse_config
from moejax.strategy.cost import PRESETS, predict_step
from moejax.strategy.offline import workload_of
from moejax.strategy.spec import Strategy

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "mixtral_8x7b.gin")
PUBLISHED_TFLOPS = 468.0
GPUS = 64
QUERY_GROUPS = 8            # Mixtral's KV heads; moejax's attention is full multi-head


def megatron_flops_per_token(w, query_groups: int) -> float:
  d, layers = w.d_model, w.num_layers
  attn = 1 + query_groups / w.num_heads + w.seq_len / d
  mlp = w.expert_d_ff / d * w.top_k * 1.5
  return 12 * layers * d * d * (attn + mlp) + 6 * d * w.vocab_size


def compare() -> dict:
  cfg = parse_config([CONFIG], [])
  w = workload_of(cfg)
  tokens = w.global_batch * w.seq_len
  published_s = tokens * megatron_flops_per_token(w, QUERY_GROUPS) / (
      GPUS * PUBLISHED_TFLOPS * 1e12)
  strategy = Strategy(8, 8, 1, dispatch="ragged")
  rows = []
  for profile in ("h100_cluster", "h100_ep_node"):
    cost = predict_step(strategy, w, PRESETS[profile])
    rows.append({"profile": profile, "strategy": strategy.spec,
                 "predicted_step_s": cost.total_s,
                 "predicted_tflops_per_gpu": tokens * megatron_flops_per_token(
                     w, QUERY_GROUPS) / (GPUS * cost.total_s) / 1e12,
                 "error": cost.total_s / published_s - 1,
                 "terms_s": {k: v for k, v in cost.to_dict().items() if k.endswith("_s")}})
  return {"published": {"tflops_per_gpu": PUBLISHED_TFLOPS, "step_s": published_s,
                        "gpus": GPUS, "layout": "TP1 EP8 PP4 VP8, MBS 1, GBS 256, seq 4096",
                        "source": "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md"},
          "rows": rows}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.published_mixtral",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--json", default=os.path.join(RESULTS, "published_mixtral.json"))
  args = parser.parse_args(argv)
  result = compare()
  pub = result["published"]
  print(f"published: {pub['tflops_per_gpu']:.0f} TFLOP/s per GPU = {pub['step_s']:.3f} s per "
        f"step ({pub['layout']}, {pub['gpus']} H100)")
  print("| profile | strategy | predicted step s | TFLOP/s per GPU | error | largest terms |")
  print("|---|---|---|---|---|---|")
  for r in result["rows"]:
    terms = sorted(((v, k) for k, v in r["terms_s"].items() if k != "total_s"), reverse=True)
    print(f"| {r['profile']} | {r['strategy']} | {r['predicted_step_s']:.3f} | "
          f"{r['predicted_tflops_per_gpu']:.0f} | {r['error']:+.0%} | " +
          ", ".join(f"{k} {v:.3f}" for v, k in terms[:4]) + " |")
  result["command"] = command("published_mixtral", argv)
  write_result(result, args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
