"""AdamW with linear warm-up, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import jax
import optax

from moejax.config import OptimConfig


def schedule(cfg: OptimConfig, num_steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=max(1, cfg.warmup_steps),
      decay_steps=max(num_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.min_lr_ratio)


def optimizer(cfg: OptimConfig, num_steps: int) -> optax.GradientTransformation:
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip_norm),
      optax.adamw(schedule(cfg, num_steps), b1=cfg.b1, b2=cfg.b2,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
