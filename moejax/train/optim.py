"""AdamW with linear warm-up, cosine decay and global-norm gradient clipping; Adam's moments
stored in float32 or, to halve their memory and bytes, bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
  lr = schedule(cfg, num_steps)
  if cfg.moments_dtype == "float32":
    adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
  else:   # optax.adamw's chain with the moments in another dtype: the same state tree
    adamw = optax.chain(scale_by_adam(cfg.b1, cfg.b2, 1e-8, jnp.dtype(cfg.moments_dtype)),
                        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
                        optax.scale_by_learning_rate(lr))
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)


def scale_by_adam(b1: float, b2: float, eps: float, dtype) -> optax.GradientTransformation:
  """optax.scale_by_adam's update with mu and nu stored in `dtype`: each step reads them,
  updates them in float32 and rounds them back (optax's own `mu_dtype` covers mu only)."""
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)

  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, dtype)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                  mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params))

  def update(updates, state, params=None):
    del params
    g = f32(updates)
    mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, g, f32(state.mu))
    nu = jax.tree.map(lambda g, v: (1 - b2) * g * g + b2 * v, g, f32(state.nu))
    count = optax.safe_increment(state.count)
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** count.astype(jnp.float32)
    out = jax.tree.map(lambda m, v, u: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(u.dtype),
                       mu, nu, updates)
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    return out, optax.ScaleByAdamState(count=count, mu=cast(mu), nu=cast(nu))

  return optax.GradientTransformation(init, update)
