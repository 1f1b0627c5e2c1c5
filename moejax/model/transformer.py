"""Decoder-only GPT-MoE in Flax Linen: RMSNorm, RoPE, causal attention, SwiGLU.

Layers are scanned in groups of `moe_every`: (moe_every - 1) dense blocks then
one MoE block, so compile time does not grow with depth. The layout rows of the
MoE layers are scanned alongside the parameters.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from moejax.config import ModelConfig, MoEConfig
from moejax.layout.tables import Layout
from moejax.model.mesh import logical_to_spec
from moejax.model.moe.fsep_experts import FsepExperts
from moejax.model.moe.layer import MoELayer, MoEStats


def _dense(name_axes, shape, fan_in, mod: nn.Module, name: str):
  init = nn.initializers.normal(stddev=fan_in ** -0.5)
  return mod.param(name, nn.with_logical_partitioning(init, name_axes), shape, jnp.float32)


class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                       (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


def rope(x_BxLxHxK: jax.Array, base: float) -> jax.Array:
  length, head_dim = x_BxLxHxK.shape[1], x_BxLxHxK.shape[3]
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angle_LxK2 = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  sin, cos = jnp.sin(angle_LxK2)[None, :, None, :], jnp.cos(angle_LxK2)[None, :, None, :]
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxLxD):
    cfg = self.cfg
    d, h = cfg.d_model, cfg.num_heads
    k = d // h
    dtype = jnp.dtype(cfg.dtype)
    qkv_axes = ("embed", "heads", "head_dim")
    wq = _dense(qkv_axes, (d, h, k), d, self, "wq")
    wk = _dense(qkv_axes, (d, h, k), d, self, "wk")
    wv = _dense(qkv_axes, (d, h, k), d, self, "wv")
    wo = _dense(("heads", "head_dim", "embed"), (h, k, d), d, self, "wo")
    x = x_BxLxD.astype(dtype)
    q_BxLxHxK = rope(jnp.einsum("bld,dhk->blhk", x, wq.astype(dtype)), cfg.rope_base)
    k_BxLxHxK = rope(jnp.einsum("bld,dhk->blhk", x, wk.astype(dtype)), cfg.rope_base)
    v_BxLxHxK = jnp.einsum("bld,dhk->blhk", x, wv.astype(dtype))
    o_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True)
    return jnp.einsum("blhk,hkd->bld", o_BxLxHxK, wo.astype(dtype))


class DenseMLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxLxD):
    d, f = self.cfg.d_model, self.cfg.d_ff
    dtype = jnp.dtype(self.cfg.dtype)
    w_gate = _dense(("embed", "mlp"), (d, f), d, self, "w_gate")
    w_up = _dense(("embed", "mlp"), (d, f), d, self, "w_up")
    w_down = _dense(("mlp", "embed"), (f, d), f, self, "w_down")
    x = x_BxLxD.astype(dtype)
    h = jax.nn.silu(x @ w_gate.astype(dtype)) * (x @ w_up.astype(dtype))
    return h @ w_down.astype(dtype)


class LayerGroup(nn.Module):
  """moe_every - 1 dense blocks followed by one MoE block; one scan step."""
  cfg: ModelConfig
  moe_cfg: MoEConfig
  mesh: Mesh

  @nn.compact
  def __call__(self, x_BxLxD, xs):
    layout, slot_weights = xs        # this layer's layout row (and fsep restored weights)
    cfg = self.cfg
    act = NamedSharding(self.mesh, logical_to_spec(("batch", "length", "embed")))
    for i in range(self.moe_cfg.moe_every - 1):
      x_BxLxD = x_BxLxD + Attention(cfg, name=f"attn_{i}")(RMSNorm(cfg.norm_eps,
                                                                    name=f"ln_attn_{i}")(x_BxLxD))
      x_BxLxD = x_BxLxD + DenseMLP(cfg, name=f"mlp_{i}")(RMSNorm(cfg.norm_eps,
                                                                  name=f"ln_mlp_{i}")(x_BxLxD))
      x_BxLxD = jax.lax.with_sharding_constraint(x_BxLxD, act)
    x_BxLxD = x_BxLxD + Attention(cfg, name="attn_moe")(RMSNorm(cfg.norm_eps,
                                                                 name="ln_attn_moe")(x_BxLxD))
    y, stats = MoELayer(self.moe_cfg, self.mesh, jnp.dtype(cfg.dtype), name="moe")(
        RMSNorm(cfg.norm_eps, name="ln_moe")(x_BxLxD), layout, slot_weights)
    x_BxLxD = jax.lax.with_sharding_constraint(x_BxLxD + y, act)
    return x_BxLxD, stats


class Transformer(nn.Module):
  cfg: ModelConfig
  moe_cfg: MoEConfig
  mesh: Mesh

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array, layout: Layout) -> tuple[jax.Array, MoEStats]:
    cfg = self.cfg
    embed = self.param("embed", nn.with_logical_partitioning(nn.initializers.normal(1.0),
                                                             ("vocab", "embed")),
                       (cfg.vocab_size, cfg.d_model), jnp.float32)
    x_BxLxD = embed[tokens_BxL].astype(jnp.dtype(cfg.dtype))
    act = NamedSharding(self.mesh, logical_to_spec(("batch", "length", "embed")))
    x_BxLxD = jax.lax.with_sharding_constraint(x_BxLxD, act)
    num_groups = cfg.num_layers // self.moe_cfg.moe_every
    slot_weights = None
    if self.moe_cfg.expert_mode == "fsep":   # restore every layer's slots before the scan
      slot_weights = FsepExperts(num_groups, self.moe_cfg.num_experts, cfg.d_model,
                                 self.moe_cfg.d_ff, self.mesh, name="fsep_experts")(
                                     layout.slot_expert_LxS)
    group = nn.remat(LayerGroup) if cfg.remat else LayerGroup
    groups = nn.scan(group, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=0, length=num_groups,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    x_BxLxD, stats = groups(cfg, self.moe_cfg, self.mesh, name="layers")(
        x_BxLxD, (layout, slot_weights))
    x_BxLxD = RMSNorm(cfg.norm_eps, name="ln_final")(x_BxLxD)
    w_out = _dense(("embed", "vocab"), (cfg.d_model, cfg.vocab_size), cfg.d_model, self,
                   "unembed")
    logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD.astype(jnp.float32), w_out)
    return logits_BxLxV, stats
