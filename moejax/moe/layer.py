"""The MoE layer: route -> layout -> dispatch -> experts -> combine, in shard_map.

`moe_apply` is the pure function (params, tokens, layout row) -> (output, stats);
`MoELayer` is the Flax module that owns the parameters and calls it. Tokens are
sharded over (data, expert); expert slots over expert; the expert FFN dim over
model. Each data row of the mesh exchanges tokens among its expert-axis devices.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moejax.config import ConfigError, MoEConfig
from moejax.mesh import BATCH_AXES, logical_to_spec
from moejax.moe import combine as combine_lib, dispatch as dispatch_lib
from moejax.moe.experts import swiglu
from moejax.moe.route import route

EXPERT_PARAM_AXES = {
    "w_gate": ("expert", "embed", "expert_mlp"),
    "w_up": ("expert", "embed", "expert_mlp"),
    "w_down": ("expert", "expert_mlp", "embed"),
}
ROUTER_AXES = ("embed", None)


class MoEStats(NamedTuple):
  counts_SxE: jax.Array      # int32 [sources, E]: choices each source device sent to each expert
  dropped_S: jax.Array       # int32 [sources]: choices each source dropped for lack of capacity
  balance_loss: jax.Array    # scalar
  z_loss: jax.Array          # scalar


def moe_apply(params: dict, x_BxLxD: jax.Array, expert_slot_E: jax.Array, cfg: MoEConfig,
              mesh: Mesh, dtype=jnp.float32) -> tuple[jax.Array, MoEStats]:
  num_dev = mesh.shape["expert"]
  num_slots = params["w_gate"].shape[0]
  if num_slots % num_dev:
    raise ConfigError(f"{num_slots} expert slots do not divide over mesh.expert={num_dev}.")
  slots = num_slots // num_dev
  shards = mesh.shape["data"] * mesh.shape["expert"]
  batch, length, d_model = x_BxLxD.shape
  if batch % shards:
    raise ConfigError(f"batch {batch} is not divisible by data*expert={shards} devices; "
                      f"use a batch size that is a multiple of {shards}.")
  num_tokens = batch // shards * length
  cap = dispatch_lib.capacity(num_tokens, cfg.top_k, num_slots, cfg.capacity_factor)

  def local(x, w_router, w_gate, w_up, w_down, expert_slot):
    x_TxD = x.reshape(-1, d_model)
    r = route(x_TxD, w_router, cfg.top_k, normalize_top_k=cfg.normalize_top_k,
              token_axes=BATCH_AXES)
    slot_A = expert_slot[r.expert_TxK.reshape(-1)]
    p = dispatch_lib.plan(slot_A, cfg.top_k, num_slots, cap)
    recv = dispatch_lib.exchange(dispatch_lib.pack(x_TxD, p), num_dev, "expert")
    h = swiglu(dispatch_lib.to_slot_major(recv, num_dev, slots), w_gate, w_up, w_down, dtype)
    h = jax.lax.psum(h, "model")
    back = dispatch_lib.exchange(dispatch_lib.from_slot_major(h, num_dev), num_dev, "expert")
    y_TxD = combine_lib.combine(back, p, r.gate_TxK)
    return (y_TxD.reshape(x.shape).astype(x.dtype), r.counts_E[None], p.dropped[None],
            r.balance_loss, r.z_loss)

  spec = {k: logical_to_spec(v) for k, v in EXPERT_PARAM_AXES.items()}
  fn = jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(BATCH_AXES), logical_to_spec(ROUTER_AXES), spec["w_gate"], spec["w_up"],
                spec["w_down"], P()),
      out_specs=(P(BATCH_AXES), P(BATCH_AXES), P(BATCH_AXES), P(), P()))
  y, counts, dropped, bal, z = fn(x_BxLxD, params["router"], params["w_gate"], params["w_up"],
                                  params["w_down"], expert_slot_E)
  return y, MoEStats(counts, dropped, bal, z)


class MoELayer(nn.Module):
  cfg: MoEConfig
  mesh: Mesh
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, expert_slot_E: jax.Array):
    d_model = x_BxLxD.shape[-1]
    num_slots = self.cfg.num_experts   # ep mode: one slot per expert
    f = self.cfg.d_ff

    def param(name, shape, fan_in):
      init = nn.initializers.normal(stddev=fan_in ** -0.5)
      return self.param(name, nn.with_logical_partitioning(init, EXPERT_PARAM_AXES[name]),
                        shape, jnp.float32)

    params = {
        "router": self.param(
            "router", nn.with_logical_partitioning(nn.initializers.normal(0.02), ROUTER_AXES),
            (d_model, self.cfg.num_experts), jnp.float32),
        "w_gate": param("w_gate", (num_slots, d_model, f), d_model),
        "w_up": param("w_up", (num_slots, d_model, f), d_model),
        "w_down": param("w_down", (num_slots, f, d_model), f),
    }
    return moe_apply(params, x_BxLxD, expert_slot_E, self.cfg, self.mesh, self.dtype)
