"""The MoE layer: route -> layout -> dispatch -> experts -> combine, in shard_map.

`moe_apply` is the pure function (params, tokens, layout row) -> (output, stats); `MoELayer`
the Flax module that owns the parameters and calls it. Tokens are sharded over (data,
expert), expert slots over expert, the expert FFN dim over model; each data row of the mesh
exchanges tokens among its expert-axis devices.

The dispatch -> experts -> combine path is chosen when the program is built, never inside
the step, from `moe.dispatch`, `moe.kernels`, `moe.capacity` and `moe.exchange_chunks`
(`dispatch_combine_fn` lists them).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moejax.config import ConfigError, MoEConfig, batch_split_error
from moejax.layout import capacity
from moejax.layout.host_layout import SHARE_PARTS
from moejax.layout.leaves import EXPERT_WEIGHTS
from moejax.layout.tables import Layout
from moejax.model.mesh import AXES, BATCH_AXES, logical_to_spec, num_stages
from moejax.model.moe import (
  chunks,
  combine as combine_lib,
  dispatch as dispatch_lib,
  grouping,
  kept_exchange,
  pooled,
  ragged,
)
from moejax.model.moe.experts import grouped_ffn, swiglu
from moejax.model.moe.ops import ops_for
from moejax.model.moe.replicas import adaptive_slots, local_replicas, split_slots
from moejax.model.moe.route import route
from pallas_kernels import compat

EXPERT_PARAM_AXES = {
    "w_gate": ("expert", "embed", "expert_mlp"),
    "w_up": ("expert", "embed", "expert_mlp"),
    "w_down": ("expert", "expert_mlp", "embed"),
}
assert tuple(EXPERT_PARAM_AXES) == EXPERT_WEIGHTS, "expert weight names live in layout.leaves"
ROUTER_AXES = ("embed", None)
# moe_apply's `exchanges`: return what a recompute of the layer would communicate again
# (moejax.model.moe.kept_exchange): the exchanges' outputs and the balance loss's shares
# (RECORD), or the shares alone (RECORD_SHARES).
RECORD, RECORD_SHARES = "record", "record_shares"


class MoEStats(NamedTuple):
  counts_WxE: jax.Array      # int32: choices each source device sent to each expert
  dropped_W: jax.Array       # int32: choices each source dropped for lack of capacity
  slot_counts_WxS: jax.Array  # int32: choices each source sent to each slot (before drops)
  balance_loss: jax.Array    # scalar
  z_loss: jax.Array          # scalar
  received_WxN: jax.Array    # int32: rows device w computed from each source of its data row
  overflow_W: jax.Array      # int32: choices routed to device w that capacity dropped


def _ep_slots(expert_TK, expert_slots_ExR, expert_parts_ExR, local_parts_S, slots):
  del expert_parts_ExR, local_parts_S, slots      # one copy per expert: the slot is fixed
  return expert_slots_ExR[expert_TK, 0]


def _replica_slots(expert_TK, expert_slots_ExR, expert_parts_ExR, local_parts_S, slots):
  device = jax.lax.axis_index("expert")
  phase = device * SHARE_PARTS // jax.lax.axis_size("expert")
  kept_E, local_E = local_replicas(expert_slots_ExR, local_parts_S, device, slots)
  return split_slots(expert_TK, expert_slots_ExR, expert_parts_ExR, phase, kept_E, local_E)


def _adaptive_slots(cap, pooled):
  """`moe.fsep_shares = 'adaptive'`: shares levelled on the step's own counts; a device keeps
  its own rows on its own replica only while its own pair stays within the buffer sized at
  factor 1 (`cap` rows per (source, slot), C of them per device when `pooled`;
  `moejax.layout.adaptive.keep_own`; None: ragged, no cap)."""
  def pick(expert_TK, expert_slots_ExR, expert_parts_ExR, local_parts_S, slots):
    del local_parts_S      # the kept rows follow the levelled quotas, not the planned parts
    return adaptive_slots(expert_TK, expert_slots_ExR, expert_parts_ExR, "expert", slots, cap,
                          pooled)
  return pick


def _dense_einsum(x_TxD, slot_TK, gate_TxK, weights, ops, num_dev, slots, cap, dtype):
  index = dispatch_lib.buffer_index(slot_TK, gate_TxK.shape[1], num_dev * slots, cap)
  recv = yield dispatch_lib.exchange(dispatch_lib.pack(x_TxD, index), num_dev, "expert")
  h = swiglu(dispatch_lib.to_slot_major(recv, num_dev, slots), *weights, dtype)
  out = yield dispatch_lib.from_slot_major(h, num_dev)
  back = yield dispatch_lib.exchange(out, num_dev, "expert")
  return (combine_lib.combine(back, index, gate_TxK), index.dropped, index.slot_counts_S,
          jnp.minimum(index.slot_counts_S, cap))


def _dense_grouped(x_TxD, slot_TK, gate_TxK, weights, ops, num_dev, slots, cap, dtype):
  index = dispatch_lib.buffer_index(slot_TK, gate_TxK.shape[1], num_dev * slots, cap)
  row_TxK = index.buf_index_TK.reshape(gate_TxK.shape)
  recv = dispatch_lib.exchange(ops.permute(x_TxD, index.buf_token_rows, row_TxK), num_dev,
                               "expert")
  recv = yield recv
  # Rows each source kept for each of my slots: [sources, C].
  kept_S = jnp.minimum(index.slot_counts_S, cap)
  kept_NxC = dispatch_lib.exchange_counts(kept_S, num_dev, "expert")
  g = grouping.group_received(grouping.dense_starts(num_dev, slots, cap), kept_NxC,
                              recv.shape[0])
  out = yield grouped_ffn(recv, g, weights, ops, dtype)
  back = yield dispatch_lib.exchange(out, num_dev, "expert")
  return ops.combine(back, row_TxK, gate_TxK), index.dropped, index.slot_counts_S, kept_S


def _ragged(x_TxD, slot_TK, gate_TxK, weights, ops, num_dev, slots, rows, dtype):
  y_TxD, slot_counts_S, dropped, kept_S = yield from ragged.ragged_stages(
      x_TxD, slot_TK, gate_TxK, weights, ops, num_dev, slots, dtype, rows)
  return y_TxD, dropped, slot_counts_S, kept_S


def _one_pipeline(cfg: MoEConfig):
  if cfg.dispatch == "ragged":
    return _ragged
  if cfg.capacity == "device":
    return pooled.pooled_dispatch_combine
  return _dense_einsum if cfg.kernels == "xla" else _dense_grouped


def dispatch_combine_fn(cfg: MoEConfig):
  """The dispatch -> experts -> combine pipeline for this config (a build-time choice): it
  returns (y_TxD, dropped, slot_counts_S, kept_S), kept_S the choices kept per slot. With
  `moe.exchange_chunks = K` > 1 the device's tokens go through it in K pieces (chunks.py).

    dense + xla     fixed-capacity buffers, all_to_all, per-slot batched einsum.
    dense + pallas  the same buffers moved by the permute / unpermute-combine kernels; the
                    received rows are packed by slot and the experts run as a grouped matmul
                    over the real rows only (capacity padding costs no FLOPs).
    ragged + either ragged_all_to_all of exactly the routed rows into a receive buffer of
                    moe.ragged_buffer_factor x T*K rows (moejax.model.moe.ragged); GPU/TPU only.
  `moe.capacity = 'device'` (dense only) pools the capacity of a device's slots into one buffer
  per (source, device) and runs a grouped matmul over it (moejax.model.moe.pooled).
  `moe.exchange_chunks = K` runs any of these on K pieces of a device's tokens, one piece's
  exchange overlapping another's compute (moejax.model.moe.chunks). F shards' partial sums are
  added over 'model' once, on the combined output.
  """
  stages = _one_pipeline(cfg)
  if cfg.exchange_chunks == 1:
    return lambda *args: chunks.whole(stages(*args))
  return chunks.chunked(stages, cfg.exchange_chunks)


def moe_apply(params: dict, x_BxQxD: jax.Array, layout: Layout, cfg: MoEConfig,
              mesh: Mesh, dtype=jnp.float32, exchanges=None):
  """(output, MoEStats). `params`: router [D, E] and slot-ordered expert weights [S, D, ffn] /
  [S, ffn, D] (the ep params, or the fsep restore); `layout`: one layer's row of a Layout.

  `exchanges` (for a backward pass that recomputes the layer; moejax.model.moe.kept_exchange):
  RECORD returns (output, MoEStats, kept), `kept` a `kept_exchange.Kept` of what the layer's
  exchanges returned (every device's rows along the first axis) and the balance loss's
  global shares; RECORD_SHARES keeps the shares alone. Such a `Kept`, given back, makes the
  recompute take those values from it instead of communicating again."""
  num_dev = mesh.shape["expert"]
  num_slots = params["w_gate"].shape[0]
  if num_slots % num_dev:
    raise ConfigError(f"{num_slots} expert slots do not divide over mesh.expert={num_dev}.")
  slots = num_slots // num_dev
  shards = mesh.shape["data"] * mesh.shape["expert"]
  batch, length, d_model = x_BxQxD.shape
  if why := batch_split_error(batch, shards):
    raise ConfigError(why + ".")
  num_tokens = batch // shards * length
  if why := chunks.split_error(num_tokens, cfg.exchange_chunks):
    raise ConfigError(why)
  num_tokens //= cfg.exchange_chunks      # capacity is per piece
  if cfg.dispatch == "ragged":   # the receive buffer's rows
    cap = capacity.ragged_rows(num_tokens, cfg.top_k, num_dev, cfg.ragged_buffer_factor)
  elif cfg.capacity == "device":
    cap = pooled.device_capacity(num_tokens, cfg.top_k, num_dev, cfg.capacity_factor)
  else:
    cap = dispatch_lib.capacity(num_tokens, cfg.top_k, num_slots, cfg.capacity_factor)
  if cfg.device_limit and not (cfg.device_limit <= num_dev and
                               cfg.device_limit * slots >= cfg.top_k):
    raise ConfigError(f"moe.device_limit={cfg.device_limit} needs <= mesh.expert={num_dev} "
                      f"devices holding >= moe.top_k={cfg.top_k} experts ({slots} per device); "
                      f"use a device_limit in [{-(-cfg.top_k // slots)}, {num_dev}] or 0.")
  # Chosen when the program is built: ep layouts have one replica per expert.
  if layout.expert_slots_LxExR.shape[-1] == 1:
    pick_slots = _ep_slots
  elif cfg.fsep_shares == "adaptive":   # kept rows within the balanced dense share
    pick_slots = _adaptive_slots(
        dispatch_lib.capacity(num_tokens, cfg.top_k, num_slots, 1.0)
        if cfg.dispatch == "dense" else None, cfg.capacity == "device")
  else:
    pick_slots = _replica_slots
  platform = mesh.devices.flat[0].platform
  if cfg.dispatch == "ragged":
    ragged.check_platform(platform)
  ops = ops_for(cfg.kernels, platform, compat.compute_capability(mesh.devices.flat[0]), dtype,
                cfg.pallas_backend)
  pipeline = dispatch_combine_fn(cfg)
  # Off where these jax releases cannot check it (pallas_kernels.compat says where and why).
  check_vma = compat.checks_varying_axes(ops.backend == "interpret", num_stages(mesh) > 1)

  recording = exchanges in (RECORD, RECORD_SHARES)

  def local(*inputs):
    *layer_inputs, replay_shards, replay_shares = inputs
    if exchanges is None:
      return layer_shard(*layer_inputs) + ((), ())
    replay = None if recording else kept_exchange.Kept(replay_shards, replay_shares)
    with kept_exchange.taping(replay, exchanges=exchanges is RECORD) as tape:
      out = layer_shard(*layer_inputs)
    kept = tape.kept()
    # every axis in the tape's spec: a buffer that is the same on each `model` shard too; the
    # shares are psums over the token axes, the same on every device
    return out + (tuple(compat.mark_varying(b, AXES) for b in kept.exchanges), kept.shares)

  def layer_shard(x, w_router, w_gate, w_up, w_down, expert_slots, expert_parts, local_parts,
                  bias):
    x_TxD = x.reshape(-1, d_model)
    r = route(x_TxD, w_router, cfg.top_k, normalize_top_k=cfg.normalize_top_k,
              token_axes=BATCH_AXES, bias_E=bias, gate=cfg.gate, route_scale=cfg.route_scale,
              seq_len=length, hosts_ExN=hosting_devices(expert_slots, num_dev, slots),
              device_limit=cfg.device_limit, num_groups=cfg.n_group,
              topk_groups=cfg.topk_group)
    slot_TK = pick_slots(r.expert_TxK.reshape(-1), expert_slots, expert_parts, local_parts, slots)
    y_TxD, dropped, slot_counts, kept = pipeline(x_TxD, slot_TK, r.gate_TxK,
                                                 (w_gate, w_up, w_down), ops, num_dev, slots,
                                                 cap, dtype)
    # With F sharded over 'model' every pipeline returns partial sums: the exchange and the
    # combine are linear, so one all-reduce of the T output rows (not of the cf*T*K buffer
    # rows) sums them, after every piece of a chunked exchange.
    y_TxD = jax.lax.psum(y_TxD, "model")
    return (y_TxD.reshape(x.shape).astype(x.dtype), r.counts_E[None], dropped[None],
            slot_counts[None], kept[None], r.balance_loss, r.z_loss)

  spec = {k: logical_to_spec(v) for k, v in EXPERT_PARAM_AXES.items()}
  fn = jax.shard_map(
      local, mesh=mesh, check_vma=check_vma,
      in_specs=(P(BATCH_AXES), logical_to_spec(ROUTER_AXES), spec["w_gate"], spec["w_up"],
                spec["w_down"], P(), P(), P(), P(), P(AXES), P()),
      out_specs=(P(BATCH_AXES),) * 5 + (P(), P(), P(AXES), P()))
  replay = (kept_exchange.Kept((), ()) if exchanges is None or recording else
            kept_exchange.Kept(*exchanges))
  y, counts, dropped, slot_counts, kept, bal, z, kept_shards, kept_shares = fn(
      x_BxQxD, params["router"], params["w_gate"], params["w_up"], params["w_down"],
      layout.expert_slots_LxExR, layout.expert_parts_LxExR, layout.slot_local_parts_LxS,
      layout.router_bias_LxE, tuple(replay.exchanges), tuple(replay.shares))
  received, overflow = realised_load(slot_counts, kept, num_dev)
  stats = MoEStats(counts, dropped, slot_counts, bal, z, received, overflow)
  if recording:
    return y, stats, kept_exchange.Kept(kept_shards, kept_shares)
  return y, stats


def no_moe_stats(cfg: MoEConfig, mesh: Mesh, layout: Layout) -> MoEStats:
  """Zero statistics of the shapes `moe_apply` returns, for a layer that routes nothing
  (`moe.dense_equivalent`)."""
  sources, num_dev = mesh.shape["data"] * mesh.shape["expert"], mesh.shape["expert"]
  zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
  return MoEStats(zeros(sources, cfg.num_experts), zeros(sources),
                  zeros(sources, layout.slot_local_parts_LxS.shape[-1]),
                  jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                  zeros(sources, num_dev), zeros(sources))


def hosting_devices(expert_slots_ExR: jax.Array, num_dev: int, slots: int) -> jax.Array:
  """bool [E, N]: device n holds a replica of expert e under this layout row (data)."""
  device_ExR = jnp.where(expert_slots_ExR >= 0, expert_slots_ExR // slots, -1)
  return jnp.any(jax.nn.one_hot(device_ExR, num_dev, dtype=jnp.bool_), axis=1)


def realised_load(slot_counts_WxS: jax.Array, kept_WxS: jax.Array,
                  num_dev: int) -> tuple[jax.Array, jax.Array]:
  """(received_WxN, overflow_W) from what each source routed to and kept for each slot.
  Sources are ordered (data row, expert device); a row's sources send only to its devices."""
  sources, num_slots = kept_WxS.shape
  rows, slots = sources // num_dev, num_slots // num_dev
  # [row, source, destination, slot] -> rows per (row, destination, source)
  kept = kept_WxS.reshape(rows, num_dev, num_dev, slots).sum(-1).transpose(0, 2, 1)
  routed_W = slot_counts_WxS.reshape(rows, num_dev, num_dev, slots).sum((1, 3)).reshape(-1)
  received_WxN = kept.reshape(sources, num_dev)
  return received_WxN, routed_W - received_WxN.sum(-1)


class MoELayer(nn.Module):
  """Owns the router (and, in ep mode, the slot-ordered expert weights)."""
  cfg: MoEConfig
  mesh: Mesh
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BxQxD: jax.Array, layout: Layout, slot_weights: dict | None = None,
               exchanges=None):
    """`slot_weights`: fsep mode passes the restored [S, ...] weights; ep mode owns them.
    `exchanges`: moe_apply's."""
    d_model = x_BxQxD.shape[-1]
    params = {"router": self.param(
        "router", nn.with_logical_partitioning(nn.initializers.normal(0.02), ROUTER_AXES),
        (d_model, self.cfg.num_experts), jnp.float32)}
    if slot_weights is None:
      size = {"embed": d_model, "expert_mlp": self.cfg.d_ff}
      for name in EXPERT_WEIGHTS:      # ep: one slot per expert, [E, D, ffn] / [E, ffn, D]
        axes = EXPERT_PARAM_AXES[name]
        init = nn.initializers.normal(stddev=size[axes[1]] ** -0.5)   # fan-in
        params[name] = self.param(
            name, nn.with_logical_partitioning(init, axes),
            (self.cfg.num_experts,) + tuple(size[a] for a in axes[1:]), jnp.float32)
    else:
      params.update(slot_weights)
    return moe_apply(params, x_BxQxD, layout, self.cfg, self.mesh, self.dtype, exchanges)
