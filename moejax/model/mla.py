"""Multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434 and 2412.19437).

Per token: the query from x (q_lora_rank 0) or through an RMS-normed latent of q_lora_rank;
keys and values from one latent of kv_lora_rank, RMS-normed, expanded per head into a key's
non-rotary part (qk_nope_head_dim) and a value (v_head_dim); the key's rotary part
(qk_rope_head_dim) comes from x directly and is shared by every head. Each head's query is
its own non-rotary and rotary parts, so a head's scores are over qk_nope + qk_rope dims and
its output over v_head_dim. The softmax scale is (qk_nope + qk_rope)^-1/2, times YaRN's
factor under `model.rope_scaling = 'yarn'` (moejax.model.rope).

Training computes the expanded keys and values (no latent cache: there is no decoding here).
Heads are sharded over `model` like the other attentions; the latents and the shared rotary
key are replicated over it. Under FSDP the up-projections from the latents, which have no
d_model dim, split their latent dim over `data` (the `latent` logical axis).

cuDNN's fused kernel (`model.attention = 'cudnn'`) takes queries, keys and values of one head
dim through `jax.nn.dot_product_attention`, so the values are padded with zeros to the query's
dim (DeepSeek-V3: 128 to 192; the padding's output is dropped, its work a third of the
values' matmul); XLA's attention (`'xla'`) takes them as they are.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model import rope as rope_lib
from pallas_kernels import compat


def qk_head_dim(cfg: ModelConfig) -> int:
  return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


def cudnn_max_head_dim(device) -> int:
  """The widest query/key head cuDNN's fused attention takes through JAX: 256 from Hopper on,
  128 before (jax's cuDNN checks)."""
  cc = compat.compute_capability(device)
  return 256 if cc and tuple(int(p) for p in cc.split(".")) >= (9, 0) else 128


class LatentNorm(nn.Module):
  """RMSNorm of a latent (its scale split over `data` under FSDP, like the latent's
  up-projection, replicated otherwise)."""
  eps: float

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("latent",)),
                       (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


def _param(mod: nn.Module, name: str, axes, shape, fan_in: int):
  init = nn.initializers.normal(stddev=fan_in ** -0.5)
  return mod.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def xla_attention(q_BxQxheadsxqk, k_BxQxheadsxqk, v_BxQxheadsxv,
                  scale: float) -> jax.Array:
  """Causal softmax attention whose values may be narrower than the keys: float32 scores and
  softmax, the weights cast to the values' dtype. The causal mask is added as a [Q, Q] bias:
  with a `where` over the scores, XLA held its predicate and fill broadcast to
  [B, heads, Q, Q] through the whole step (40 GiB a GPU at DeepSeek-V3's 128 heads and 4
  sequences of 4K); an add's backward reads neither."""
  logits = jnp.einsum("bqhj,bkhj->bhqk", q_BxQxheadsxqk, k_BxQxheadsxqk,
                      preferred_element_type=jnp.float32) * scale
  length = q_BxQxheadsxqk.shape[1]
  causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
  logits = logits + jnp.where(causal, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_BxQxheadsxv.dtype)
  return jnp.einsum("bhqk,bkhv->bqhv", probs, v_BxQxheadsxv)


def attend(q, k, v, scale: float, implementation: str) -> jax.Array:
  """`implementation` 'cudnn': the fused kernel, values zero-padded to the keys' dim (see the
  module doc); anything else: `xla_attention`."""
  if implementation != "cudnn":
    return xla_attention(q, k, v, scale)
  pad = q.shape[-1] - v.shape[-1]
  v_padded = jnp.pad(v, ((0, 0),) * 3 + ((0, pad),)) if pad else v
  out = jax.nn.dot_product_attention(q, k, v_padded, scale=scale, is_causal=True,
                                     implementation="cudnn")
  return out[..., :v.shape[-1]]


class MLAttention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxQxD):
    cfg = self.cfg
    d, h, nope, rot = cfg.d_model, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    rank_q, rank_kv, vdim = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim
    dtype = jnp.dtype(cfg.dtype)
    x = x_BxQxD.astype(dtype)
    heads = ("heads", "head_dim")
    if rank_q:
      wq_a = _param(self, "wq_a", ("embed", None), (d, rank_q), d)
      wq_b = _param(self, "wq_b", ("latent",) + heads, (rank_q, h, nope + rot), rank_q)
      c_q = LatentNorm(cfg.norm_eps, name="q_norm")(x @ wq_a.astype(dtype))
      q_BxQxheadsxqk = jnp.einsum("bqr,rhj->bqhj", c_q, wq_b.astype(dtype))
    else:
      wq = _param(self, "wq", ("embed",) + heads, (d, h, nope + rot), d)
      q_BxQxheadsxqk = jnp.einsum("bqd,dhj->bqhj", x, wq.astype(dtype))
    # one projection to the latent and the shared rotary key, as DeepSeek stores it
    wkv_a = _param(self, "wkv_a", ("embed", None), (d, rank_kv + rot), d)
    wkv_b = _param(self, "wkv_b", ("latent",) + heads, (rank_kv, h, nope + vdim), rank_kv)
    wo = _param(self, "wo", heads + ("embed",), (h, vdim, d), h * vdim)
    latent_BxQxrank = x @ wkv_a.astype(dtype)
    c_kv = LatentNorm(cfg.norm_eps, name="kv_norm")(latent_BxQxrank[..., :rank_kv])
    kv_BxQxheadsxkv = jnp.einsum("bqr,rhw->bqhw", c_kv, wkv_b.astype(dtype))
    inv_freq = rope_lib.inv_frequencies(cfg, rot)
    on_angles, on_softmax = rope_lib.attention_factors(cfg)
    q_rot = rope_lib.apply_rope(q_BxQxheadsxqk[..., nope:], inv_freq, on_angles)
    k_rot_BxQx1xrot = rope_lib.apply_rope(latent_BxQxrank[..., None, rank_kv:], inv_freq,
                                          on_angles)
    q_BxQxheadsxqk = jnp.concatenate([q_BxQxheadsxqk[..., :nope], q_rot], axis=-1)
    k_BxQxheadsxqk = jnp.concatenate(
        [kv_BxQxheadsxkv[..., :nope], jnp.broadcast_to(k_rot_BxQx1xrot, q_rot.shape)], axis=-1)
    scale = (nope + rot) ** -0.5 * on_softmax
    o_BxQxheadsxv = attend(q_BxQxheadsxqk, k_BxQxheadsxqk, kv_BxQxheadsxkv[..., nope:], scale,
                           cfg.attention)
    return jnp.einsum("bqhv,hvd->bqd", o_BxQxheadsxv, wo.astype(dtype))
