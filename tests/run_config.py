"""The tiny end-to-end run the trainer tests share: its config and readers of what it writes."""

from __future__ import annotations

import json
import os

from moejax.config import (
  CheckpointConfig,
  Config,
  DataConfig,
  MeshConfig,
  ModelConfig,
  MoEConfig,
  OptimConfig,
  TrainConfig,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 8 * 32   # global_batch_size * seq_len
TOP_K = 2


def tiny_config(run_dir, num_steps: int, every: int, keep: int = 2, eval_every: int = 100,
                warmup_steps: int = 30) -> Config:
  return Config(
      mesh=MeshConfig(data=2, expert=4, model=1),
      model=ModelConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_seq_len=32),
      moe=MoEConfig(num_experts=8, top_k=TOP_K, d_ff=32, moe_every=2),
      data=DataConfig(seq_len=32, global_batch_size=8, max_corpus_bytes=200_000),
      optim=OptimConfig(warmup_steps=warmup_steps),
      checkpoint=CheckpointConfig(every=every, keep=keep),
      train=TrainConfig(run_dir=str(run_dir), num_steps=num_steps, eval_every=eval_every,
                        eval_batches=2, progress_bar=False))


def read_jsonl(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f]


def checkpoint_steps(run_dir) -> list[int]:
  names = os.listdir(os.path.join(run_dir, "checkpoints"))
  return sorted(int(n) for n in names if n.isdigit())


def step_losses(records: list[dict]) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in records if "loss" in r}
