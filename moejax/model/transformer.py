"""Decoder-only GPT-MoE in Flax Linen: RMSNorm, RoPE, causal (grouped-query) attention with
optional QK-norm, SwiGLU.

After `moe.first_dense` dense first blocks, layers are scanned in groups of `moe_every`:
(moe_every - 1) dense blocks then one MoE block (with the shared experts beside it, if any),
so compile time does not grow with depth. The layout rows of the MoE layers are scanned
alongside the parameters. In fsep mode the scan carries the restored expert weights of the
layer it computes and restores the next layer's (double buffering), so that exchange does not
wait for this layer's compute; the backward pass does the same the other way
(moejax.model.moe.fsep_backward).

The Transformer hands out its parts, `embed`, `groups` and `head`, and its output is the
head (`Head`: final-normed hidden states and the unembedding), which the loss takes whole:
nothing outside this package reads a parameter by its name.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from moejax.config import ModelConfig, MoEConfig, num_moe_layers
from moejax.layout.tables import Layout
from moejax.model import mla
from moejax.model.mesh import logical_to_spec
from moejax.model.moe import dispatch, fsep_backward, route
from moejax.model.moe.fsep_experts import FsepExperts, restore_layer
from moejax.model.moe.layer import MoELayer, MoEStats, no_moe_stats
from moejax.model.mtp import MultiTokenPrediction
from pallas_kernels import compat


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
  fused = (compat.is_nvidia_gpu(device.platform) and
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


def attention_class(cfg: ModelConfig) -> type[nn.Module]:
  """Multi-head latent attention where model.kv_lora_rank > 0, else (grouped) multi-head."""
  return mla.MLAttention if cfg.kv_lora_rank else Attention


def remat_kwargs(cfg: ModelConfig) -> dict:
  """The checkpoint policy of a rematerialised layer group: everything recomputed but the
  balance loss's global shares per expert ([E] floats a layer, moejax.model.moe.route), whose
  recompute is an all-reduce in the backward pass that queued behind the layer's weight
  gathers; with `model.remat_keeps_exchange` the MoE exchanges' outputs kept too
  (moejax.model.moe.dispatch)."""
  names = (route.SHARES, dispatch.EXCHANGED) if cfg.remat_keeps_exchange else (route.SHARES,)
  return {"policy": jax.checkpoint_policies.save_only_these_names(*names)}


def dense_modules(cfg: ModelConfig, remat: bool) -> tuple[type[nn.Module], type[nn.Module]]:
  """(attention, MLP) module classes of a dense block, rematerialised when `remat`: the one
  place a block's modules are chosen (the attention by `attention_class`)."""
  attention = attention_class(cfg)
  return (nn.remat(attention), nn.remat(DenseMLP)) if remat else (attention, DenseMLP)


def dense_block(x_BxQxD, ln_attn, attn, ln_mlp, mlp, act: NamedSharding) -> jax.Array:
  """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), sharded as `act`."""
  x_BxQxD = x_BxQxD + attn(ln_attn(x_BxQxD))
  x_BxQxD = x_BxQxD + mlp(ln_mlp(x_BxQxD))
  return jax.lax.with_sharding_constraint(x_BxQxD, act)


def _activations(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(("batch", "length", "embed")))


class GroupCarry(NamedTuple):
  """What one layer group hands the next: the same structure in every mode, None where a mode
  has nothing to carry."""
  x_BxQxD: jax.Array
  weights: dict | None = None    # fsep: the restored expert weights of the group's MoE layer
  channel: dict | None = None    # fsep, PREFETCH backward: moejax.model.moe.fsep_backward's


class LayerGroup(nn.Module):
  """moe_every - 1 dense blocks followed by one MoE block; one step of the layer scan,
  GroupCarry -> GroupCarry.

  fsep: `fsep` = (every layer's stored expert weights, slot_expert_LxS), broadcast to every
  step. The step computes its MoE layer on `carry.weights` and restores the next layer's into
  the carry it returns (the last step wraps to layer 0, a result nobody reads), so that
  exchange has no data dependence on this layer's compute."""
  cfg: ModelConfig
  moe_cfg: MoEConfig
  mesh: Mesh
  # fsep: how the backward pass gets this layer's restored weights (fsep_backward's KEEP,
  # RERESTORE or PREFETCH; PREFETCH carries them back through `carry.channel`)
  backward: str = fsep_backward.PREFETCH
  fsdp: bool = False             # fsep: restores keep FSDP's embed shards (restore_layer)

  @nn.compact
  def __call__(self, carry: GroupCarry, xs, fsep=None) -> tuple[GroupCarry, MoEStats]:
    layout, layer = xs               # this layer's layout row and its index in the scan
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    x_BxQxD, next_weights = carry.x_BxQxD, None
    if fsep is not None:
      stored, slot_expert_LxS = fsep
      next_layer = (layer + 1) % slot_expert_LxS.shape[0]
      next_weights = restore_layer(stored, slot_expert_LxS, next_layer, self.mesh, dtype,
                                   self.fsdp)
    act = _activations(self.mesh)
    # fsep under remat checkpoints the part of the group before its MoE layer as one (its
    # input is what the backward pass keeps of it, with the MoE layer's input): a checkpoint
    # of the whole group would keep its input, this layer's restored weights, for the backward
    # pass; and each part checkpointed apart would keep its own input, the norms' float32
    # ones among them (six [B, Q, D] arrays a layer, 1.3 GB of Mixtral's at 4 x 4096 a GPU).
    trunk = nn.remat(_trunk) if cfg.remat and fsep is not None else _trunk
    x_BxQxD, h_BxQxD = trunk(self, x_BxQxD)
    _, mlp = dense_modules(cfg, cfg.remat and fsep is not None)
    channel = carry.channel
    if self.moe_cfg.dense_equivalent:   # the MoE layer's active FLOPs as one dense SwiGLU
      y = mlp(cfg, self.moe_cfg.top_k * self.moe_cfg.d_ff, name="moe_dense")(h_BxQxD)
      stats = no_moe_stats(self.moe_cfg, self.mesh, layout)
    else:
      moe = MoELayer(self.moe_cfg, self.mesh, dtype, name="moe")
      if fsep is None:
        y, stats = moe(h_BxQxD, layout)
      else:
        (y, stats), channel = fsep_backward.fsep_moe(
            moe, self.backward, self.fsdp, cfg.remat_keeps_exchange)(
            moe, h_BxQxD, layout, carry.weights, channel, stored, slot_expert_LxS, layer)
    if self.moe_cfg.num_shared_experts:   # one SwiGLU as wide as all shared experts together
      width = self.moe_cfg.num_shared_experts * (self.moe_cfg.shared_d_ff or self.moe_cfg.d_ff)
      y = y + mlp(cfg, width, name="shared")(h_BxQxD)
    x_BxQxD = jax.lax.with_sharding_constraint(x_BxQxD + y, act)
    return GroupCarry(x_BxQxD, next_weights, channel), stats


def _trunk(group: LayerGroup, x_BxQxD: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A layer group's blocks before its MoE layer: its moe_every - 1 dense blocks and the MoE
  block's attention; (x_BxQxD after them, the MoE layer's input, normed). Its modules are
  `group`'s (their parameter paths are the group's)."""
  cfg, act = group.cfg, _activations(group.mesh)
  attn, mlp = dense_modules(cfg, False)
  norm = lambda name: RMSNorm(cfg.norm_eps, name=name, parent=group)
  for i in range(group.moe_cfg.moe_every - 1):
    x_BxQxD = dense_block(x_BxQxD, norm(f"ln_attn_{i}"), attn(cfg, name=f"attn_{i}", parent=group),
                          norm(f"ln_mlp_{i}"), mlp(cfg, name=f"mlp_{i}", parent=group), act)
  x_BxQxD = x_BxQxD + attn(cfg, name="attn_moe", parent=group)(norm("ln_attn_moe")(x_BxQxD))
  return x_BxQxD, norm("ln_moe")(x_BxQxD)


class Head(NamedTuple):
  """The model's output on a batch: the final-normed hidden states and the unembedding. A
  loss takes it whole (moejax.train.loss), so that a tiled loss never holds all the logits."""
  h_BxQxD: jax.Array
  w_Dxvocab: jax.Array

  def logits(self) -> jax.Array:
    """logits_BxQxvocab, in float32."""
    return jnp.einsum("bqd,dv->bqv", self.h_BxQxD.astype(jnp.float32), self.w_Dxvocab)


class MtpHead(NamedTuple):
  """The multi-token head's output (model.mtp_depth = 1): position i's `Head` predicts the
  token after its next one; the losses of its block's MoE layer, for the loss to add."""
  head: Head
  balance_loss: jax.Array
  z_loss: jax.Array


class GroupParams(NamedTuple):
  """The layer groups' parameters, every leaf [G, ...] in the params' layer order."""
  layers: dict                   # the scanned LayerGroup's
  stored: dict | None            # fsep: every MoE layer's stored expert weights (ep: None)


class Transformer(nn.Module):
  """tokens -> (Head, MoEStats), in three parts a caller may run apart (the pipeline does):
  `embed` (the token embedding and the dense first blocks), `groups` (the scanned layer
  groups) and `head` (the final norm and the unembedding); `layer_group` and `group_params`
  hand out one group's module and the groups' parameters to a caller that schedules the
  groups itself. With `model.mtp_depth` = 1 a fourth part, `mtp_head` beside `head`, and the
  output is ((Head, MtpHead), MoEStats). Parameter paths: `embed`,
  `first_{attn,mlp,ln_attn,ln_mlp}_{i}`, `layers` (every leaf [G, ...]), `fsep_experts`
  (fsep), `ln_final`, `unembed`, `mtp` (multi-token prediction)."""
  cfg: ModelConfig
  moe_cfg: MoEConfig
  mesh: Mesh
  fsdp: bool = False     # parameters' embed dims over data (mesh.fsdp): fsep's restores keep it

  def setup(self):
    cfg, moe_cfg = self.cfg, self.moe_cfg
    self.embedding = self.param("embed", nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")), (cfg.vocab_size, cfg.d_model),
                                jnp.float32)
    attn, mlp = dense_modules(cfg, cfg.remat)
    first = range(moe_cfg.first_dense)   # dense first layers, outside the scan
    self.first_ln_attn = [RMSNorm(cfg.norm_eps) for _ in first]
    self.first_attn = [attn(cfg) for _ in first]
    self.first_ln_mlp = [RMSNorm(cfg.norm_eps) for _ in first]
    self.first_mlp = [mlp(cfg) for _ in first]
    num_groups = num_moe_layers(cfg, moe_cfg)
    fsep = moe_cfg.expert_mode == "fsep"
    if fsep:   # restores the first layer; the scan the others
      self.fsep_experts = FsepExperts(num_groups, moe_cfg.num_experts, cfg.d_model,
                                      moe_cfg.d_ff, self.mesh, jnp.dtype(cfg.dtype), self.fsdp)
    group = nn.remat(LayerGroup, **remat_kwargs(cfg)) if cfg.remat and not fsep else LayerGroup
    self.layers = nn.scan(group, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=(0, nn.broadcast) if fsep else 0, length=num_groups,
                          metadata_params={nn.PARTITION_NAME: "layers"})(
                              cfg, moe_cfg, self.mesh, fsep_backward.PREFETCH, self.fsdp)
    self.ln_final = RMSNorm(cfg.norm_eps)
    self.unembedding = _dense(("embed", "vocab"), (cfg.d_model, cfg.vocab_size), cfg.d_model,
                              self, "unembed")
    if cfg.mtp_depth:   # its block's modules as the others', the whole block rematerialised
      mtp = nn.remat(MultiTokenPrediction, **remat_kwargs(cfg)) if cfg.remat else \
          MultiTokenPrediction
      self.mtp = mtp(cfg, moe_cfg, self.mesh, RMSNorm, *dense_modules(cfg, False))

  def embed(self, tokens_BxQ: jax.Array) -> jax.Array:
    """x_BxQxD: the token embedding, then the `moe.first_dense` dense first blocks."""
    act = _activations(self.mesh)
    x_BxQxD = self.embedding[tokens_BxQ].astype(jnp.dtype(self.cfg.dtype))
    x_BxQxD = jax.lax.with_sharding_constraint(x_BxQxD, act)
    for blocks in zip(self.first_ln_attn, self.first_attn, self.first_ln_mlp, self.first_mlp):
      x_BxQxD = dense_block(x_BxQxD, *blocks, act)
    return x_BxQxD

  def groups(self, x_BxQxD: jax.Array, layout: Layout) -> tuple[jax.Array, MoEStats]:
    """(x_BxQxD, stats [G, ...]): the G layer groups, scanned. fsep carries each layer's
    restored weights to its group and their backward restores back (fsep_backward)."""
    num_groups = num_moe_layers(self.cfg, self.moe_cfg)
    if self.moe_cfg.expert_mode != "fsep":
      carry, stats = self.layers(GroupCarry(x_BxQxD), (layout, jnp.arange(num_groups)))
      return carry.x_BxQxD, stats
    table = layout.slot_expert_LxS
    stored, first = self.fsep_experts(table)
    carry = GroupCarry(x_BxQxD, first, fsep_backward.open_channel(first, self.mesh, self.fsdp))
    carry, stats = self.layers(carry, (layout, jnp.arange(num_groups)), (stored, table))
    return fsep_backward.close_channel(carry.x_BxQxD, carry.channel, stored, table, self.mesh,
                                       jnp.dtype(self.cfg.dtype), self.fsdp), stats

  def head(self, x_BxQxD: jax.Array) -> Head:
    """The final norm on x, and the unembedding."""
    return Head(self.ln_final(x_BxQxD), self.unembedding)

  def mtp_head(self, x_BxQxD: jax.Array, next_tokens_BxQ: jax.Array) -> MtpHead:
    """Multi-token prediction (moejax.model.mtp): the final norm on the groups' x and the
    shared embedding of each position's next token through the module's block; its `Head`
    (the shared unembedding) predicts the token after next."""
    next_BxQxD = self.embedding[next_tokens_BxQ].astype(jnp.dtype(self.cfg.dtype))
    next_BxQxD = jax.lax.with_sharding_constraint(next_BxQxD, _activations(self.mesh))
    h_BxQxD, balance_loss, z_loss = self.mtp(self.ln_final(x_BxQxD), next_BxQxD)
    return MtpHead(Head(h_BxQxD, self.unembedding), balance_loss, z_loss)

  def __call__(self, tokens_BxQ: jax.Array, layout: Layout,
               next_tokens_BxQ: jax.Array | None = None):
    """(Head, stats); with `model.mtp_depth` = 1, ((Head, MtpHead), stats), the multi-token
    head fed `next_tokens_BxQ` (each position's next token: the loss's targets; by default
    the tokens shifted by one, the last standing in for the unknown one after it)."""
    x_BxQxD, stats = self.groups(self.embed(tokens_BxQ), layout)
    if not self.cfg.mtp_depth:
      return self.head(x_BxQxD), stats
    if next_tokens_BxQ is None:
      next_tokens_BxQ = jnp.concatenate([tokens_BxQ[:, 1:], tokens_BxQ[:, -1:]], axis=1)
    return (self.head(x_BxQxD), self.mtp_head(x_BxQxD, next_tokens_BxQ)), stats

  def layer_group(self, backward: str) -> LayerGroup:
    """One layer group's module (unbound; parameters: one [G, ...] row of `group_params`),
    its fsep backward pass as `backward` says (fsep_backward: the pipeline's stage vmap cannot
    carry PREFETCH's channel across its ticks); its fsep restores keep FSDP's shards as the
    Transformer's own groups' do (`fsdp`)."""
    return LayerGroup(self.cfg, self.moe_cfg, self.mesh, backward, self.fsdp, parent=None)

  @staticmethod
  def group_params(params: dict) -> GroupParams:
    return GroupParams(params["layers"], params.get("fsep_experts"))
