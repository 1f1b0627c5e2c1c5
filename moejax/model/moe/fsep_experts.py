"""FSEP expert parameters: stored in expert order, F sharded over all group devices.

`FsepExperts` owns the `[layers, E, D, F]` / `[layers, E, F, D]` weights of every
MoE layer (outside the layer scan) and restores the slot-ordered weights of all
layers in one shard_map before the scan runs, so every layer's restore is issued
before any layer's expert compute and XLA may overlap them (at the cost of
holding all layers' restored slots: see moejax.memory).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moejax.model.mesh import logical_to_spec
from moejax.model.moe.restore import restore_local

FSEP_PARAM_AXES = {
    "w_gate": ("layers", None, "embed", "fsep_mlp"),
    "w_up": ("layers", None, "embed", "fsep_mlp"),
    "w_down": ("layers", None, "fsep_mlp", "embed"),
}
SLOT_AXES = {
    "w_gate": ("layers", "expert", "embed", "expert_mlp"),
    "w_up": ("layers", "expert", "embed", "expert_mlp"),
    "w_down": ("layers", "expert", "expert_mlp", "embed"),
}
F_AXIS = {"w_gate": 3, "w_up": 3, "w_down": 2}


def restore_slot_weights(weights: dict, slot_expert_LxS: jax.Array, mesh: Mesh) -> dict:
  """Expert-ordered sharded weights -> slot-ordered weights, sharded like ep weights."""
  num_dev = mesh.shape["expert"]
  names = sorted(weights)

  def local(slot_expert, *ws):
    return tuple(restore_local(w, slot_expert, num_dev, F_AXIS[n]) for n, w in zip(names, ws))

  fn = jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(),) + tuple(logical_to_spec(FSEP_PARAM_AXES[n]) for n in names),
      out_specs=tuple(logical_to_spec(SLOT_AXES[n]) for n in names))
  return dict(zip(names, fn(slot_expert_LxS, *(weights[n] for n in names))))


class FsepExperts(nn.Module):
  num_layers: int
  num_experts: int
  d_model: int
  d_ff: int
  mesh: Mesh

  @nn.compact
  def __call__(self, slot_expert_LxS: jax.Array) -> dict:
    d, f = self.d_model, self.d_ff
    shapes = {"w_gate": ((self.num_layers, self.num_experts, d, f), d),
              "w_up": ((self.num_layers, self.num_experts, d, f), d),
              "w_down": ((self.num_layers, self.num_experts, f, d), f)}
    weights = {
        name: self.param(name, nn.with_logical_partitioning(
            nn.initializers.normal(stddev=fan_in ** -0.5), FSEP_PARAM_AXES[name]),
            shape, jnp.float32)
        for name, (shape, fan_in) in shapes.items()}
    return restore_slot_weights(weights, slot_expert_LxS, self.mesh)
