"""Decoder-only GPT-MoE in Flax Linen: RMSNorm, RoPE, causal (grouped-query) attention with
optional QK-norm, SwiGLU.

After `moe.first_dense` dense first blocks, layers are scanned in groups of `moe_every`:
(moe_every - 1) dense blocks then one MoE block (with the shared experts beside it, if any),
so compile time does not grow with depth. The layout rows of the
MoE layers are scanned alongside the parameters. In fsep mode the scan carries the
restored expert weights of the layer it computes and restores the next layer's
(double buffering), so that exchange does not wait for this layer's compute; the backward
pass does the same the other way: layer l's backward restores layer l-1's weights and hands
them back through the scan (`_prefetching_moe`).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from moejax.config import ModelConfig, MoEConfig, num_moe_layers
from moejax.layout.tables import Layout
from moejax.model import mla
from moejax.model.mesh import logical_to_spec
from moejax.model.moe.fsep_experts import FsepExperts, restore_layer
from moejax.model.moe.layer import MoELayer, MoEStats, no_moe_stats
from moejax.model.mtp import MultiTokenPrediction


def resolve_attention(cfg: ModelConfig, mesh: Mesh) -> ModelConfig:
  """`cfg` with `attention = 'auto'` replaced by the implementation for `mesh`'s devices:
  cuDNN's fused kernel on GPU where its constraints hold, XLA's attention elsewhere (also on
  compile-only GPU devices, where XLA finds no cuDNN to build the fused kernel with). MLA's
  head is its query/key width (moejax.model.mla)."""
  if cfg.attention != "auto":
    return cfg
  device = mesh.devices.flat[0]
  head_dim = (mla.qk_head_dim(cfg) if cfg.kv_lora_rank else
              cfg.head_dim or cfg.d_model // cfg.num_heads)
  fused = (device.platform in ("gpu", "cuda") and
           device.client.runtime_type != "compile_only_runtime" and
           cfg.dtype in ("bfloat16", "float16") and head_dim % 8 == 0 and
           head_dim <= mla.cudnn_max_head_dim(device))
  return dataclasses.replace(cfg, attention="cudnn" if fused else "xla")


def _dense(name_axes, shape, fan_in, mod: nn.Module, name: str):
  init = nn.initializers.normal(stddev=fan_in ** -0.5)
  return mod.param(name, nn.with_logical_partitioning(init, name_axes), shape, jnp.float32)


class RMSNorm(nn.Module):
  """Normalises over the trailing dims named by `axes` (logical names; one scale per element)."""
  eps: float
  axes: tuple[str, ...] = ("embed",)

  @nn.compact
  def __call__(self, x):
    dims = tuple(range(-len(self.axes), 0)) if len(self.axes) > 1 else -1
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, self.axes),
                       x.shape[x.ndim - len(self.axes):], jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=dims, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


def rope(x_BxQxheadsxhdim: jax.Array, base: float) -> jax.Array:
  length, head_dim = x_BxQxheadsxhdim.shape[1], x_BxQxheadsxhdim.shape[3]
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angle = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]   # [Q, J/2]
  sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
  x1, x2 = jnp.split(x_BxQxheadsxhdim.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxQxheadsxhdim.dtype)


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxQxD):
    cfg = self.cfg
    d, h, kv = cfg.d_model, cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    head_dim = cfg.head_dim or d // h
    dtype = jnp.dtype(cfg.dtype)
    qkv_axes = ("embed", "heads", "head_dim")
    wq = _dense(qkv_axes, (d, h, head_dim), d, self, "wq")
    # kv < h k/v heads: dot_product_attention gives query head i the k/v head i // (h / kv)
    wk = _dense(qkv_axes, (d, kv, head_dim), d, self, "wk")
    wv = _dense(qkv_axes, (d, kv, head_dim), d, self, "wv")
    wo = _dense(("heads", "head_dim", "embed"), (h, head_dim, d), d, self, "wo")
    x = x_BxQxD.astype(dtype)
    q_BxQxheadsxhdim = jnp.einsum("bqd,dhj->bqhj", x, wq.astype(dtype))
    k_BxQxheadsxhdim = jnp.einsum("bqd,dhj->bqhj", x, wk.astype(dtype))
    if cfg.qk_norm != "none":
      axes = ("head_dim",) if cfg.qk_norm == "head" else ("heads", "head_dim")
      q_BxQxheadsxhdim = RMSNorm(cfg.norm_eps, axes, name="q_norm")(q_BxQxheadsxhdim)
      k_BxQxheadsxhdim = RMSNorm(cfg.norm_eps, axes, name="k_norm")(k_BxQxheadsxhdim)
    q_BxQxheadsxhdim = rope(q_BxQxheadsxhdim, cfg.rope_base)
    k_BxQxheadsxhdim = rope(k_BxQxheadsxhdim, cfg.rope_base)
    v_BxQxheadsxhdim = jnp.einsum("bqd,dhj->bqhj", x, wv.astype(dtype))
    # 'cudnn': the fused kernel; anything else (an unresolved 'auto' too): XLA's attention
    impl = "cudnn" if cfg.attention == "cudnn" else None
    o_BxQxheadsxhdim = jax.nn.dot_product_attention(q_BxQxheadsxhdim, k_BxQxheadsxhdim,
                                                    v_BxQxheadsxhdim, is_causal=True,
                                                    implementation=impl)
    return jnp.einsum("bqhj,hjd->bqd", o_BxQxheadsxhdim, wo.astype(dtype))


def attention_class(cfg: ModelConfig) -> type[nn.Module]:
  """Multi-head latent attention where model.kv_lora_rank > 0, else (grouped) multi-head."""
  return mla.MLAttention if cfg.kv_lora_rank else Attention


class DenseMLP(nn.Module):
  """SwiGLU, hidden dim over 'model'. `d_ff` 0: the model's; the shared experts set theirs."""
  cfg: ModelConfig
  d_ff: int = 0

  @nn.compact
  def __call__(self, x_BxQxD):
    d, f = self.cfg.d_model, self.d_ff or self.cfg.d_ff
    dtype = jnp.dtype(self.cfg.dtype)
    w_gate = _dense(("embed", "mlp"), (d, f), d, self, "w_gate")
    w_up = _dense(("embed", "mlp"), (d, f), d, self, "w_up")
    w_down = _dense(("mlp", "embed"), (f, d), f, self, "w_down")
    x = x_BxQxD.astype(dtype)
    h = jax.nn.silu(x @ w_gate.astype(dtype)) * (x @ w_up.astype(dtype))
    return h @ w_down.astype(dtype)


# The name scope of the backward pass's weight restores (the compiled program's op names tell
# them from the forward's restores and from the restores' transposes, the gradient return).
BACKWARD_RESTORE = "backward_restore"


def _recomputing_moe(moe: MoELayer, backward_weights):
  """`moe(x, layout, weights)`, plus a `channel` passed through unchanged, whose backward
  pass recomputes the layer from weights it gets again instead of the forward keeping every
  layer's restored weights until its backward pass: `backward_weights(ct_channel, stored,
  slot_expert_LxS, layer)` gives (this layer's weights, the cotangent of the channel input)."""
  def call(mdl, x, layout, weights, channel, stored, slot_expert_LxS, layer):
    del stored, slot_expert_LxS, layer          # the backward pass's inputs
    return mdl(x, layout, weights), channel

  def fwd(mdl, x, layout, weights, channel, stored, slot_expert_LxS, layer):
    res = (mdl.variables["params"], x, layout, stored, slot_expert_LxS, layer)   # no `weights`
    return (mdl(x, layout, weights), channel), res

  def bwd(res, ct):
    params, x, layout, stored, slot_expert_LxS, layer = res
    ct_out, ct_channel = ct
    weights, ct_channel_in = backward_weights(ct_channel, stored, slot_expert_LxS, layer)
    apply = lambda p, x, w: MoELayer(moe.cfg, moe.mesh, moe.dtype).apply({"params": p}, x,
                                                                          layout, w)
    ct_params, ct_x, ct_weights = jax.vjp(apply, params, x, weights)[1](ct_out)
    return {"params": ct_params}, ct_x, None, ct_weights, ct_channel_in, None, None, None

  return nn.custom_vjp(call, fwd, bwd)


def _backward_restore(stored, slot_expert_LxS, layer, mesh: Mesh, dtype):
  with jax.named_scope(BACKWARD_RESTORE):
    return restore_layer(stored, slot_expert_LxS, layer, mesh, dtype)


def _rerestoring_moe(moe: MoELayer):
  """`_recomputing_moe` whose backward pass restores this layer's weights again from the
  stored shards (one more exchange); its channel is None."""
  def backward_weights(ct_channel, stored, slot_expert_LxS, layer):
    del ct_channel
    return _backward_restore(stored, slot_expert_LxS, layer, moe.mesh, moe.dtype), None

  return _recomputing_moe(moe, backward_weights)


def _prefetching_moe(moe: MoELayer):
  """`_recomputing_moe` whose channel (the shape of one layer's restored weights) carries
  restored weights backwards through the layer scan: layer l's backward pass takes its own
  weights from the cotangent of its channel output (restored during layer l+1's backward, or
  by `_seed_backward_restore` for the last layer) and returns layer l-1's, restored now, as
  the cotangent of its channel input, so that restore overlaps this layer's backward compute
  instead of preceding it."""
  def backward_weights(ct_channel, stored, slot_expert_LxS, layer):
    previous = (layer - 1) % slot_expert_LxS.shape[0]    # layer 0 wraps: nobody reads it
    return ct_channel, _backward_restore(stored, slot_expert_LxS, previous, moe.mesh, moe.dtype)

  return _recomputing_moe(moe, backward_weights)


def _seed_backward_restore(mesh: Mesh, dtype):
  """seed(x, channel, stored, slot_expert_LxS) = x, whose backward restores the last MoE
  layer's weights as the cotangent of the layer scan's final `channel` (`_prefetching_moe`):
  the first backward restore, issued before the head's backward."""
  @jax.custom_vjp
  def seed(x, channel, stored, slot_expert_LxS):
    del channel, stored, slot_expert_LxS
    return x

  def fwd(x, channel, stored, slot_expert_LxS):
    del channel
    return x, (stored, slot_expert_LxS)

  def bwd(res, ct_x):
    stored, slot_expert_LxS = res
    last = _backward_restore(stored, slot_expert_LxS, slot_expert_LxS.shape[0] - 1, mesh, dtype)
    return ct_x, last, None, None

  seed.defvjp(fwd, bwd)
  return seed


class LayerGroup(nn.Module):
  """moe_every - 1 dense blocks followed by one MoE block; one scan step.

  ep: carry = x. fsep: carry = (x, this MoE layer's restored weights); `fsep` = (every layer's
  stored expert weights, slot_expert_LxS), broadcast to every step, from which the step
  restores the next layer's weights (the last step wraps to layer 0, a result nobody reads) so
  that exchange has no data dependence on this layer's compute."""
  cfg: ModelConfig
  moe_cfg: MoEConfig
  mesh: Mesh
  # fsep: the backward pass restores the weights again (False: keeps the forward's, where
  # pallas_kernels.compat.rerestores_fsep says the re-restoring vjp cannot run)
  rerestore: bool = True
  # fsep with rerestore: the carry has a third member, the backward restore's channel
  # (`_prefetching_moe`), so that layer l's backward restores layer l-1's weights
  prefetch_backward: bool = False

  @nn.compact
  def __call__(self, carry, xs, fsep=None):
    layout, layer = xs               # this layer's layout row and its index in the scan
    cfg = self.cfg
    channel = None
    if fsep is None:
      x_BxQxD, slot_weights = carry, None
    elif self.prefetch_backward:
      (x_BxQxD, slot_weights, channel), (stored, slot_expert_LxS) = carry, fsep
    else:
      (x_BxQxD, slot_weights), (stored, slot_expert_LxS) = carry, fsep
    if fsep is not None:
      next_layer = (layer + 1) % slot_expert_LxS.shape[0]
      next_weights = restore_layer(stored, slot_expert_LxS, next_layer, self.mesh,
                                   jnp.dtype(cfg.dtype))
    # fsep under remat checkpoints the dense blocks one by one: a checkpoint of the whole
    # group would keep its input, this layer's restored weights, for the backward pass.
    attention = attention_class(cfg)
    attn, mlp = (nn.remat(attention), nn.remat(DenseMLP)) if cfg.remat and fsep else (
        attention, DenseMLP)
    act = NamedSharding(self.mesh, logical_to_spec(("batch", "length", "embed")))
    for i in range(self.moe_cfg.moe_every - 1):
      x_BxQxD = x_BxQxD + attn(cfg, name=f"attn_{i}")(RMSNorm(cfg.norm_eps,
                                                               name=f"ln_attn_{i}")(x_BxQxD))
      x_BxQxD = x_BxQxD + mlp(cfg, name=f"mlp_{i}")(RMSNorm(cfg.norm_eps,
                                                             name=f"ln_mlp_{i}")(x_BxQxD))
      x_BxQxD = jax.lax.with_sharding_constraint(x_BxQxD, act)
    x_BxQxD = x_BxQxD + attn(cfg, name="attn_moe")(RMSNorm(cfg.norm_eps,
                                                            name="ln_attn_moe")(x_BxQxD))
    h_BxQxD = RMSNorm(cfg.norm_eps, name="ln_moe")(x_BxQxD)
    if self.moe_cfg.dense_equivalent:   # the MoE layer's active FLOPs as one dense SwiGLU
      y = mlp(cfg, self.moe_cfg.top_k * self.moe_cfg.d_ff, name="moe_dense")(h_BxQxD)
      stats = no_moe_stats(self.moe_cfg, self.mesh, layout)
    else:
      moe = MoELayer(self.moe_cfg, self.mesh, jnp.dtype(cfg.dtype), name="moe")
      if fsep is None or not self.rerestore:
        y, stats = moe(h_BxQxD, layout, slot_weights)
      else:   # `channel` is None unless prefetching
        wrap = _prefetching_moe if self.prefetch_backward else _rerestoring_moe
        (y, stats), channel = wrap(moe)(moe, h_BxQxD, layout, slot_weights, channel, stored,
                                        slot_expert_LxS, layer)
    if self.moe_cfg.num_shared_experts:   # one SwiGLU as wide as all shared experts together
      width = self.moe_cfg.num_shared_experts * (self.moe_cfg.shared_d_ff or self.moe_cfg.d_ff)
      y = y + mlp(cfg, width, name="shared")(h_BxQxD)
    x_BxQxD = jax.lax.with_sharding_constraint(x_BxQxD + y, act)
    if fsep is None:
      return x_BxQxD, stats
    return ((x_BxQxD, next_weights, channel) if self.prefetch_backward else
            (x_BxQxD, next_weights)), stats


class Transformer(nn.Module):
  cfg: ModelConfig
  moe_cfg: MoEConfig
  mesh: Mesh

  @nn.compact
  def __call__(self, tokens_BxQ: jax.Array, layout: Layout, hidden: bool = False,
               mtp_tokens_BxQ: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
    """(logits_BxQxvocab, stats); `hidden`: (the final normed hidden states, stats), for a loss
    that applies the unembedding itself (moejax.train.loss.tiled_cross_entropy).
    `mtp_tokens_BxQ` (each position's next token; model.mtp_depth = 1): ((out, (the
    multi-token module's logits or hidden states, its balance loss, its z-loss)), stats)."""
    cfg = self.cfg
    embed = self.param("embed", nn.with_logical_partitioning(nn.initializers.normal(1.0),
                                                             ("vocab", "embed")),
                       (cfg.vocab_size, cfg.d_model), jnp.float32)
    x_BxQxD = embed[tokens_BxQ].astype(jnp.dtype(cfg.dtype))
    act = NamedSharding(self.mesh, logical_to_spec(("batch", "length", "embed")))
    x_BxQxD = jax.lax.with_sharding_constraint(x_BxQxD, act)
    attention = attention_class(cfg)
    attn, mlp = (nn.remat(attention), nn.remat(DenseMLP)) if cfg.remat else (attention, DenseMLP)
    for i in range(self.moe_cfg.first_dense):    # dense first layers, outside the scan
      x_BxQxD = x_BxQxD + attn(cfg, name=f"first_attn_{i}")(
          RMSNorm(cfg.norm_eps, name=f"first_ln_attn_{i}")(x_BxQxD))
      x_BxQxD = x_BxQxD + mlp(cfg, name=f"first_mlp_{i}")(
          RMSNorm(cfg.norm_eps, name=f"first_ln_mlp_{i}")(x_BxQxD))
      x_BxQxD = jax.lax.with_sharding_constraint(x_BxQxD, act)
    num_groups = num_moe_layers(cfg, self.moe_cfg)
    carry, fsep, in_axes = x_BxQxD, (), 0
    if self.moe_cfg.expert_mode == "fsep":   # restore the first layer; the scan the others
      stored, first = FsepExperts(num_groups, self.moe_cfg.num_experts, cfg.d_model,
                                  self.moe_cfg.d_ff, self.mesh, jnp.dtype(cfg.dtype),
                                  name="fsep_experts")(layout.slot_expert_LxS)
      carry = (x_BxQxD, first, jax.tree.map(jnp.zeros_like, first))   # + the channel
      in_axes = (0, nn.broadcast)
      fsep = ((stored, layout.slot_expert_LxS),)
    group = nn.remat(LayerGroup) if cfg.remat and not fsep else LayerGroup
    groups = nn.scan(group, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=in_axes, length=num_groups,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    carry, stats = groups(cfg, self.moe_cfg, self.mesh, prefetch_backward=bool(fsep),
                          name="layers")(carry, (layout, jnp.arange(num_groups)), *fsep)
    x_BxQxD = carry[0] if fsep else carry
    if fsep:
      x_BxQxD = _seed_backward_restore(self.mesh, jnp.dtype(cfg.dtype))(x_BxQxD, carry[2],
                                                                         *fsep[0])
    x_BxQxD = RMSNorm(cfg.norm_eps, name="ln_final")(x_BxQxD)
    mtp = None
    if cfg.mtp_depth and (mtp_tokens_BxQ is not None or self.is_initializing()):
      module = nn.remat(MultiTokenPrediction) if cfg.remat else MultiTokenPrediction
      nxt = embed[tokens_BxQ if mtp_tokens_BxQ is None else mtp_tokens_BxQ]
      mtp = module(cfg, self.moe_cfg, self.mesh, RMSNorm, attention, DenseMLP, name="mtp")(
          x_BxQxD, jax.lax.with_sharding_constraint(nxt.astype(jnp.dtype(cfg.dtype)), act))
    if hidden:
      out = x_BxQxD
    else:
      w_out = _dense(("embed", "vocab"), (cfg.d_model, cfg.vocab_size), cfg.d_model, self,
                     "unembed")
      out = jnp.einsum("bqd,dv->bqv", x_BxQxD.astype(jnp.float32), w_out)
    if mtp_tokens_BxQ is None:
      return out, stats
    mtp_out = mtp[0] if hidden else jnp.einsum("bqd,dv->bqv", mtp[0].astype(jnp.float32), w_out)
    return (out, (mtp_out,) + mtp[1:]), stats
