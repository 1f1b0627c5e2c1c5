"""Rotary position embeddings for multi-head latent attention: plain, or YaRN-scaled.

The frequencies are computed as transformers computes them (float32, `1 / base^(2i/dim)`), so
that a converted DeepSeek-V3 sees the same angles. YaRN (Peng et al. 2023, arXiv:2309.00071)
keeps the high frequencies (fewer than `beta_slow` rotations over the original length are
interpolated by `factor`, more than `beta_fast` kept, a linear ramp between) and scales the
attention: cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) (or
mscale(factor) where either term is absent), the softmax by mscale(factor, mscale_all_dim)^2
(DeepSeek-V3's softmax scale), mscale(s, m) = 0.1 m ln s + 1 for s > 1, else 1.

The rotation pairs dimension i with i + dim/2 (the halves layout); DeepSeek's checkpoints pair
neighbours (2i, 2i+1), which `moejax.convert` turns into halves by permuting the rotary rows
of the projections: the scores are the same sums.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(cfg: ModelConfig, dim: int) -> np.ndarray:
  """float32 [dim / 2]: the rotation frequency of each dimension pair."""
  base = np.float32(cfg.rope_base)
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  if cfg.rope_scaling == "none":
    return (np.float32(1.0) / pos_freqs).astype(np.float32)
  factor = cfg.rope_factor
  original = cfg.rope_original_max_len or cfg.max_seq_len

  def correction_dim(rotations):
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_base))

  low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
  high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
  if low == high:
    high += 0.001     # no singularity
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) /
                 np.float32(high - low), 0, 1).astype(np.float32)
  extrapolation = np.float32(1) - ramp
  inv_extra = np.float32(1.0) / pos_freqs
  inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
  return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def attention_factors(cfg: ModelConfig) -> tuple[float, float]:
  """(the factor on cos and sin, the factor on the softmax scale) of the config's scaling."""
  if cfg.rope_scaling == "none":
    return 1.0, 1.0
  f, m, m_all = cfg.rope_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
  on_angles = yarn_mscale(f, m) / yarn_mscale(f, m_all) if m and m_all else yarn_mscale(f)
  on_softmax = yarn_mscale(f, m_all) ** 2 if m_all else 1.0
  return on_angles, on_softmax


def apply_rope(x_BxQxheadsxrot: jax.Array, inv_freq: np.ndarray, factor: float) -> jax.Array:
  """x rotated by position (0 .. Q-1) times `inv_freq`, halves layout, cos and sin times
  `factor`; the angles in float32, the result in x's dtype."""
  length = x_BxQxheadsxrot.shape[1]
  angle_QxR2 = jnp.arange(length, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None]
  cos = (jnp.cos(angle_QxR2) * factor)[None, :, None, :]
  sin = (jnp.sin(angle_QxR2) * factor)[None, :, None, :]
  x1, x2 = jnp.split(x_BxQxheadsxrot.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxQxheadsxrot.dtype)
