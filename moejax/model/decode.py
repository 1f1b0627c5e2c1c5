"""The Transformer's forward pass for decoding: a KV cache, so a new token costs one pass through
the layers at one position, not a re-run of the prompt.

`forward` runs Q new tokens per row at positions start_B .. start_B + Q - 1 (the prompt at 0
when prefilling, one token at its row's position when decoding), writes their keys and values
into the cache at those positions and attends to every cached position up to its own. The
cache is fixed-length (a decode step compiles once for every position): grouped-query
attention caches each layer's keys (after RoPE) and values, [B, L, kv_heads, head_dim];
multi-head latent attention caches the normed latent [B, L, kv_lora_rank] and the shared
rotary key [B, L, qk_rope_head_dim] and attends in the latent (the key and value expansions
folded into the query and the output: DeepSeek-V2's absorbed form), so its cache is that of
one narrow head. A row's positions past its own are masked, so rows of different prompt
lengths share a batch: a shorter prompt's padding is overwritten by its own decoded tokens
before any query sees it.

The blocks are the Transformer's own modules (`RMSNorm`, `DenseMLP`, MLA's `LatentNorm`)
applied to their parameters, the attention projections and RoPE as the modules compute them;
the MoE layer routes as training does (the trained router bias, device- and group-limited
routing) and computes every choice (`moejax.model.moe.dropless`). The layer groups are
scanned, as in the Transformer. `tests/test_generate.py` holds the logits equal to one full
forward pass of the Transformer at every position, in ep and fsep layouts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig, MoEConfig, num_moe_layers
from moejax.layout.canonical import canonical_state
from moejax.layout.leaves import EXPERT_WEIGHTS
from moejax.layout.tables import Layout
from moejax.model import mla, rope as rope_lib
from moejax.model.moe.dropless import dropless_experts
from moejax.model.moe.layer import hosting_devices
from moejax.model.moe.route import route
from moejax.model.transformer import DenseMLP, Head, RMSNorm


class DecodeParams(NamedTuple):
  """The parameters decoding reads, expert weights in expert-id order."""
  embed_vocabxD: jax.Array
  first: tuple                 # each dense first block's {ln_attn, attn, ln_mlp, mlp}
  layers: dict                 # the scanned layer groups' parameters, every leaf [G, ...]
  experts: dict | None         # {w_gate, w_up, w_down} [G, E, ...] (None: dense_equivalent)
  ln_final: dict
  unembed_Dxvocab: jax.Array


class Cache(NamedTuple):
  first: tuple                 # each dense first block's attention cache
  groups: dict                 # per attention of a group ('attn_0', .., 'attn_moe'), [G, ...]


def decode_params(params: dict, layout: Layout, expert_mode: str) -> DecodeParams:
  """A Transformer's parameters (canonical layer order, as checkpoints hold them) under
  `layout` in `expert_mode`, as decoding reads them."""
  params = canonical_state(params, layout, expert_mode)
  layers = dict(params["layers"])
  if expert_mode == "fsep":
    experts = {w: params["fsep_experts"][w] for w in EXPERT_WEIGHTS}
  elif "moe" in layers:
    experts = {w: layers["moe"][w] for w in EXPERT_WEIGHTS}
    layers["moe"] = {"router": layers["moe"]["router"]}
  else:
    experts = None
  first = tuple({part: params[f"first_{part}_{i}"] for part in ("ln_attn", "attn", "ln_mlp", "mlp")}
                for i in range(sum(1 for k in params if k.startswith("first_attn_"))))
  return DecodeParams(params["embed"], first, layers, experts, params["ln_final"],
                      params["unembed"])


def _attention_names(moe_cfg: MoEConfig) -> list[str]:
  return [f"attn_{i}" for i in range(moe_cfg.moe_every - 1)] + ["attn_moe"]


def _one_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
  dtype = jnp.dtype(cfg.dtype)
  if cfg.kv_lora_rank:
    return {"latent": jnp.zeros((batch, length, cfg.kv_lora_rank), dtype),
            "k_rot": jnp.zeros((batch, length, cfg.qk_rope_head_dim), dtype)}
  kv = cfg.num_kv_heads or cfg.num_heads
  head_dim = cfg.head_dim or cfg.d_model // cfg.num_heads
  return {"k": jnp.zeros((batch, length, kv, head_dim), dtype),
          "v": jnp.zeros((batch, length, kv, head_dim), dtype)}


def empty_cache(cfg: ModelConfig, moe_cfg: MoEConfig, batch: int, length: int) -> Cache:
  """A cache of `length` positions for `batch` rows, zeros (no position is read before it is
  written)."""
  groups = num_moe_layers(cfg, moe_cfg)
  stacked = lambda: jax.tree.map(lambda a: jnp.broadcast_to(a, (groups,) + a.shape),
                                 _one_cache(cfg, batch, length))
  return Cache(tuple(_one_cache(cfg, batch, length) for _ in range(moe_cfg.first_dense)),
               {name: stacked() for name in _attention_names(moe_cfg)})


def cache_bytes(cfg: ModelConfig, moe_cfg: MoEConfig, batch: int, length: int) -> int:
  shapes = jax.eval_shape(lambda: empty_cache(cfg, moe_cfg, batch, length))
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))


def _norm(cfg: ModelConfig, scale: dict, x, axes=("embed",)):
  return RMSNorm(cfg.norm_eps, axes).apply({"params": scale}, x)


def _rotate(x_BxQxheadsxR: jax.Array, positions_BxQ: jax.Array, inv_freq_R2,
            factor: float = 1.0) -> jax.Array:
  """RoPE at each row's own positions (the halves layout of the model's `rope`)."""
  angle_BxQxR2 = positions_BxQ.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_R2)
  cos = (jnp.cos(angle_BxQxR2) * factor)[:, :, None, :]
  sin = (jnp.sin(angle_BxQxR2) * factor)[:, :, None, :]
  x1, x2 = jnp.split(x_BxQxheadsxR.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxQxheadsxR.dtype)


def _write(cache_BxLx: jax.Array, new_BxQx: jax.Array, positions_BxQ: jax.Array) -> jax.Array:
  rows_Bx1 = jnp.arange(cache_BxLx.shape[0])[:, None]
  return cache_BxLx.at[rows_Bx1, positions_BxQ].set(new_BxQx.astype(cache_BxLx.dtype))


def _visible(positions_BxQ: jax.Array, length: int) -> jax.Array:
  """bool [B, Q, L]: cache position l is at or before the query's own."""
  return jnp.arange(length)[None, None, :] <= positions_BxQ[:, :, None]


def _softmax(logits_BxhxQxL: jax.Array, visible_BxQxL: jax.Array) -> jax.Array:
  masked = jnp.where(visible_BxQxL[:, None], logits_BxhxQxL, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(masked, axis=-1)


def _gqa(cfg: ModelConfig, p: dict, x_BxQxD, positions_BxQ, cache: dict):
  """Grouped-query attention (`transformer.Attention`) over the cached keys and values."""
  h, kv = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
  head_dim = cfg.head_dim or cfg.d_model // h
  dtype = jnp.dtype(cfg.dtype)
  x = x_BxQxD.astype(dtype)
  q_BxQxheadsxhdim = jnp.einsum("bqd,dhj->bqhj", x, p["wq"].astype(dtype))
  k_BxQxkvxhdim = jnp.einsum("bqd,dhj->bqhj", x, p["wk"].astype(dtype))
  if cfg.qk_norm != "none":
    axes = ("head_dim",) if cfg.qk_norm == "head" else ("heads", "head_dim")
    q_BxQxheadsxhdim = _norm(cfg, p["q_norm"], q_BxQxheadsxhdim, axes)
    k_BxQxkvxhdim = _norm(cfg, p["k_norm"], k_BxQxkvxhdim, axes)
  inv_freq = cfg.rope_base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  q_BxQxheadsxhdim = _rotate(q_BxQxheadsxhdim, positions_BxQ, inv_freq)
  k_BxQxkvxhdim = _rotate(k_BxQxkvxhdim, positions_BxQ, inv_freq)
  v_BxQxkvxhdim = jnp.einsum("bqd,dhj->bqhj", x, p["wv"].astype(dtype))
  cache = {"k": _write(cache["k"], k_BxQxkvxhdim, positions_BxQ),
           "v": _write(cache["v"], v_BxQxkvxhdim, positions_BxQ)}
  batch, length = x.shape[0], x.shape[1]
  # query head i reads k/v head i // (h / kv), as dot_product_attention does
  q_BxQxkvxgxhdim = q_BxQxheadsxhdim.reshape(batch, length, kv, h // kv, head_dim)
  logits = jnp.einsum("bqkgj,blkj->bkgql", q_BxQxkvxgxhdim, cache["k"],
                      preferred_element_type=jnp.float32) * head_dim ** -0.5
  logits_Bxheadsx = logits.reshape(batch, h, length, -1)
  probs = _softmax(logits_Bxheadsx, _visible(positions_BxQ, cache["k"].shape[1]))
  probs_BxkvxgxQxL = probs.reshape(logits.shape).astype(dtype)
  o_BxQxkvxgxhdim = jnp.einsum("bkgql,blkj->bqkgj", probs_BxkvxgxQxL, cache["v"])
  o_BxQxheadsxhdim = o_BxQxkvxgxhdim.reshape(batch, length, h, head_dim)
  return jnp.einsum("bqhj,hjd->bqd", o_BxQxheadsxhdim, p["wo"].astype(dtype)), cache


def _mla(cfg: ModelConfig, p: dict, x_BxQxD, positions_BxQ, cache: dict):
  """Multi-head latent attention (`mla.MLAttention`) in the latent: the scores of the
  non-rotary parts are q_nope . (W_k c) = (W_k^T q_nope) . c over the cached latents c, the
  output W_v (sum of probs * c)."""
  nope, rot, rank_kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
  dtype = jnp.dtype(cfg.dtype)
  x = x_BxQxD.astype(dtype)
  latent_norm = lambda scale, v: mla.LatentNorm(cfg.norm_eps).apply({"params": scale}, v)
  if cfg.q_lora_rank:
    c_q = latent_norm(p["q_norm"], x @ p["wq_a"].astype(dtype))
    q_BxQxheadsxqk = jnp.einsum("bqr,rhj->bqhj", c_q, p["wq_b"].astype(dtype))
  else:
    q_BxQxheadsxqk = jnp.einsum("bqd,dhj->bqhj", x, p["wq"].astype(dtype))
  latent_BxQxrank = x @ p["wkv_a"].astype(dtype)
  c_kv_BxQxrank = latent_norm(p["kv_norm"], latent_BxQxrank[..., :rank_kv])
  inv_freq = rope_lib.inv_frequencies(cfg, rot)
  on_angles, on_softmax = rope_lib.attention_factors(cfg)
  q_rot_BxQxheadsxrot = _rotate(q_BxQxheadsxqk[..., nope:], positions_BxQ, inv_freq, on_angles)
  k_rot_BxQxrot = _rotate(latent_BxQxrank[..., None, rank_kv:], positions_BxQ, inv_freq,
                          on_angles)[:, :, 0]
  cache = {"latent": _write(cache["latent"], c_kv_BxQxrank, positions_BxQ),
           "k_rot": _write(cache["k_rot"], k_rot_BxQxrot, positions_BxQ)}
  wkv_b = p["wkv_b"].astype(dtype)                       # [rank, heads, nope + v]
  q_latent_BxQxheadsxrank = jnp.einsum("bqhn,rhn->bqhr", q_BxQxheadsxqk[..., :nope],
                                       wkv_b[..., :nope])
  logits = (jnp.einsum("bqhr,blr->bhql", q_latent_BxQxheadsxrank, cache["latent"],
                       preferred_element_type=jnp.float32) +
            jnp.einsum("bqhj,blj->bhql", q_rot_BxQxheadsxrot, cache["k_rot"],
                       preferred_element_type=jnp.float32)) * ((nope + rot) ** -0.5 * on_softmax)
  probs = _softmax(logits, _visible(positions_BxQ, cache["latent"].shape[1])).astype(dtype)
  o_latent_BxQxheadsxrank = jnp.einsum("bhql,blr->bqhr", probs, cache["latent"])
  o_BxQxheadsxv = jnp.einsum("bqhr,rhv->bqhv", o_latent_BxQxheadsxrank, wkv_b[..., nope:])
  return jnp.einsum("bqhv,hvd->bqd", o_BxQxheadsxv, p["wo"].astype(dtype)), cache


def _attention(cfg: ModelConfig, p: dict, x_BxQxD, positions_BxQ, cache: dict):
  return (_mla if cfg.kv_lora_rank else _gqa)(cfg, p, x_BxQxD, positions_BxQ, cache)


def _dense_block(cfg: ModelConfig, p: dict, x_BxQxD, positions_BxQ, cache: dict):
  """One pre-norm dense block (`transformer.dense_block`), p: {ln_attn, attn, ln_mlp, mlp}."""
  a_BxQxD, cache = _attention(cfg, p["attn"], _norm(cfg, p["ln_attn"], x_BxQxD), positions_BxQ,
                              cache)
  x_BxQxD = x_BxQxD + a_BxQxD
  y_BxQxD = DenseMLP(cfg).apply({"params": p["mlp"]}, _norm(cfg, p["ln_mlp"], x_BxQxD))
  return x_BxQxD + y_BxQxD, cache


def _moe(moe_cfg: MoEConfig, router_DxE, experts: dict, h_BxQxD, layout: Layout,
         expert_devices: int, dtype):
  """The MoE layer on one layout row: routed as training routes, every choice computed."""
  h_TxD = h_BxQxD.reshape(-1, h_BxQxD.shape[-1])
  hosts_ExN = None
  if moe_cfg.device_limit:   # the devices of the layout the run trained with
    slots = layout.slot_expert_LxS.shape[-1] // expert_devices
    hosts_ExN = hosting_devices(layout.expert_slots_LxExR, expert_devices, slots)
  r = route(h_TxD, router_DxE, moe_cfg.top_k, normalize_top_k=moe_cfg.normalize_top_k,
            bias_E=layout.router_bias_LxE, gate=moe_cfg.gate, route_scale=moe_cfg.route_scale,
            seq_len=h_BxQxD.shape[1], hosts_ExN=hosts_ExN, device_limit=moe_cfg.device_limit,
            num_groups=moe_cfg.n_group, topk_groups=moe_cfg.topk_group)
  y_TxD = dropless_experts(h_TxD, r.expert_TxK, r.gate_TxK, experts["w_gate"], experts["w_up"],
                           experts["w_down"], dtype)
  return y_TxD.reshape(h_BxQxD.shape)


def forward(dp: DecodeParams, tokens_BxQ: jax.Array, start_B: jax.Array, cache: Cache,
            layout: Layout, cfg: ModelConfig, moe_cfg: MoEConfig,
            expert_devices: int = 1) -> tuple[jax.Array, Cache]:
  """(h_BxQxD, cache): the final-normed hidden states of `tokens_BxQ` at positions start_B +
  0 .. Q-1 of each row (`logits` turns them into logits), and the cache with their keys and
  values written. `layout`: the run's (its router bias the trained one); `expert_devices`: the
  expert-axis size it placed experts over (read only by device-limited routing)."""
  dtype = jnp.dtype(cfg.dtype)
  positions_BxQ = start_B[:, None] + jnp.arange(tokens_BxQ.shape[1])[None, :]
  x_BxQxD = dp.embed_vocabxD[tokens_BxQ].astype(dtype)
  first = []
  for block, block_cache in zip(dp.first, cache.first):
    x_BxQxD, block_cache = _dense_block(cfg, block, x_BxQxD, positions_BxQ, block_cache)
    first.append(block_cache)

  def group(x_BxQxD, xs):
    p, experts, group_cache, row = xs
    out = {}
    for i in range(moe_cfg.moe_every - 1):
      block = {part: p[f"{part}_{i}"] for part in ("ln_attn", "attn", "ln_mlp", "mlp")}
      x_BxQxD, out[f"attn_{i}"] = _dense_block(cfg, block, x_BxQxD, positions_BxQ,
                                               group_cache[f"attn_{i}"])
    a_BxQxD, out["attn_moe"] = _attention(cfg, p["attn_moe"], _norm(cfg, p["ln_attn_moe"],
                                                                    x_BxQxD),
                                          positions_BxQ, group_cache["attn_moe"])
    x_BxQxD = x_BxQxD + a_BxQxD
    h_BxQxD = _norm(cfg, p["ln_moe"], x_BxQxD)
    if moe_cfg.dense_equivalent:
      y_BxQxD = DenseMLP(cfg, moe_cfg.top_k * moe_cfg.d_ff).apply({"params": p["moe_dense"]},
                                                                  h_BxQxD)
    else:
      y_BxQxD = _moe(moe_cfg, p["moe"]["router"], experts, h_BxQxD, row, expert_devices, dtype)
    if moe_cfg.num_shared_experts:
      width = moe_cfg.num_shared_experts * (moe_cfg.shared_d_ff or moe_cfg.d_ff)
      y_BxQxD = y_BxQxD + DenseMLP(cfg, width).apply({"params": p["shared"]}, h_BxQxD)
    return x_BxQxD + y_BxQxD, out

  x_BxQxD, groups = jax.lax.scan(group, x_BxQxD, (dp.layers, dp.experts, cache.groups, layout))
  return _norm(cfg, dp.ln_final, x_BxQxD), Cache(tuple(first), groups)


def logits(dp: DecodeParams, h_BxQxD: jax.Array) -> jax.Array:
  """float32 logits_BxQxvocab of `forward`'s hidden states (the model's `Head`)."""
  return Head(h_BxQxD, dp.unembed_Dxvocab).logits()
