"""FSEP expert parameters: stored in expert order, F sharded over all group devices.

`FsepExperts` owns the `[layers, E, D, ffn]` / `[layers, E, ffn, D]` weights of every MoE layer
(outside the layer scan, so the parameter paths are `['fsep_experts'][w]`). It restores only
the first MoE layer's slots; the scanned layer group restores layer l+1's (`restore_layer`)
in the iteration that computes layer l, so each restore can overlap the previous layer's
compute. Restored weights are in the compute dtype.

Under FSDP (`fsdp`) the restore keeps the weights' embed dim sharded over `data`, as FSDP
stores it: the exchange moves 1/data of each slot's weights, and the restored weights are
gathered over `data` in the compute dtype: in the forward where the MoE layer takes them, in
the backward a layer ahead with the restore (`gathered`, moejax.model.moe.fsep_backward).
Gathering the stored shards before the restore instead moves float32 and holds every expert's
shard of the layer (Mixtral-8x7B on 64 compile-only H100s: the same gathered bytes, 8 times
the exchange's, and a layer 0.162 -> 0.143 s in the schedule estimate).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.layout.leaves import EXPERT_WEIGHTS
from moejax.model.mesh import param_rules
from moejax.model.moe.layer import EXPERT_PARAM_AXES
from moejax.model.moe.restore import restore_local

# Restored (slot-ordered) weights are sharded like the ep ones, with a leading layer axis; the
# stored weights are in expert order with the FFN axis split over (expert, model).
SLOT_AXES = {name: ("layers",) + EXPERT_PARAM_AXES[name] for name in EXPERT_WEIGHTS}
FSEP_PARAM_AXES = {
    name: ("layers", None) + tuple("fsep_mlp" if a == "expert_mlp" else a for a in axes[2:])
    for name, axes in SLOT_AXES.items()}
F_AXIS = {name: axes.index("expert_mlp") for name, axes in SLOT_AXES.items()}


def _spec(names, fsdp: bool) -> P:
  rules = dict(param_rules(fsdp))
  return P(*(None if n is None else rules[n] for n in names))


def restore_slot_weights(weights: dict, slot_expert_LxS: jax.Array, mesh: Mesh,
                         dtype=None, fsdp: bool = False) -> dict:
  """Expert-ordered sharded weights -> slot-ordered weights, sharded like ep weights, in
  `dtype` (default: the weights' own); with `fsdp`, both with their embed dim over `data`."""
  num_dev = mesh.shape["expert"]
  names = sorted(weights)

  def local(slot_expert, *ws):
    with jax.named_scope("fsep_restore"):       # names the exchange in the compiled program
      return tuple(restore_local(w, slot_expert, num_dev, F_AXIS[n], dtype)
                   for n, w in zip(names, ws))

  fn = jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(),) + tuple(_spec(FSEP_PARAM_AXES[n], fsdp) for n in names),
      out_specs=tuple(_spec(SLOT_AXES[n], fsdp) for n in names))
  return dict(zip(names, fn(slot_expert_LxS, *(weights[n] for n in names))))


def restore_layer(weights: dict, slot_expert_LxS: jax.Array, layer: jax.Array | int, mesh: Mesh,
                  dtype=None, fsdp: bool = False) -> dict:
  """One MoE layer's slot-ordered weights ([S, D, ffn] / [S, ffn, D]) from every layer's stored
  weights; `layer` may be traced (the layer scan's index); `fsdp`: restore_slot_weights'."""
  # The layer is sliced where its stored shards lie: left to propagate, XLA's partitioner
  # gathers a sharding the restore does not take (FSDP's data-axis shards of the embed dim)
  # on the whole [layers, ...] stack before a traced slice, every layer.
  take = lambda a: jax.lax.dynamic_slice_in_dim(a, layer, 1, axis=0)
  local = lambda a: jax.lax.with_sharding_constraint(
      take(a), NamedSharding(mesh, P(*[P.UNCONSTRAINED] * a.ndim)))
  restored = restore_slot_weights({n: local(w) for n, w in weights.items()},
                                  take(slot_expert_LxS), mesh, dtype, fsdp)
  return {n: w[0] for n, w in restored.items()}


def gathered(restored: dict, mesh: Mesh) -> dict:
  """One layer's restored weights ([S, ...]) with FSDP's data-axis shards of the embed dim
  gathered: laid out as the MoE layer computes with them."""
  return {n: jax.lax.with_sharding_constraint(
      w, NamedSharding(mesh, _spec(SLOT_AXES[n][1:], False))) for n, w in restored.items()}


class FsepExperts(nn.Module):
  num_layers: int
  num_experts: int
  d_model: int
  d_ff: int
  mesh: Mesh
  dtype: jnp.dtype = jnp.float32     # of the restored weights (the compute dtype)
  fsdp: bool = False                 # the weights' embed dim over data (restore_slot_weights)

  @nn.compact
  def __call__(self, slot_expert_LxS: jax.Array) -> tuple[dict, dict]:
    """-> (every layer's stored weights [L, E, ...], the first layer's restored [S, ...])."""
    size = {"embed": self.d_model, "expert_mlp": self.d_ff}
    weights = {}
    for name in EXPERT_WEIGHTS:
      axes = EXPERT_PARAM_AXES[name]     # [E, D, ffn] or [E, ffn, D]; stored per layer
      shape = (self.num_layers, self.num_experts) + tuple(size[a] for a in axes[1:])
      init = nn.initializers.normal(stddev=size[axes[1]] ** -0.5)      # fan-in
      weights[name] = self.param(
          name, nn.with_logical_partitioning(init, FSEP_PARAM_AXES[name]), shape, jnp.float32)
    return weights, restore_layer(weights, slot_expert_LxS, 0, self.mesh, self.dtype, self.fsdp)
