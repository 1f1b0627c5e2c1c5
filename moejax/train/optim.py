"""AdamW with linear warm-up, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import jax
import optax

from moejax.config import OptimConfig


def schedule(cfg: OptimConfig, num_steps: int) -> optax.Schedule:
  """Learning rate of step s (0-based): linear warm-up reaching the peak at step
  warmup_steps - 1, then cosine decay. Shifted by one so step 0 already learns."""
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=max(1, cfg.warmup_steps),
      decay_steps=max(num_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.min_lr_ratio)
  return lambda step: base(step + 1)


def optimizer(cfg: OptimConfig, num_steps: int) -> optax.GradientTransformation:
  def decay_mask(params):   # no decay on RMSNorm scales (which are [layers, D] when scanned)
    # nor on a routing bias held as a parameter (the multi-token module's: no gradient)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in ("scale", "router_bias"), params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip_norm),
      optax.adamw(schedule(cfg, num_steps), b1=cfg.b1, b2=cfg.b2,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
