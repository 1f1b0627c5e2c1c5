"""Expert layouts: which expert each slot hosts. A layout is *data* fed to the step.

A device on the expert axis owns `C` consecutive slots; slot `s` lives on device
`s // C`. In `ep` mode a slot physically owns its expert's weights, so the
weights of all MoE layers are stored in slot order `[layers, N*C, ...]`.
Changing a layout changes only these int32 arrays, never the compiled program.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ConfigError


@flax.struct.dataclass
class Layout:
  slot_expert_LxS: jax.Array   # int32 [moe_layers, N*C]: expert hosted by each slot
  expert_slot_LxE: jax.Array   # int32 [moe_layers, E]: the slot that serves each expert

  @property
  def num_layers(self) -> int:
    return self.slot_expert_LxS.shape[0]

  @property
  def num_slots(self) -> int:
    return self.slot_expert_LxS.shape[1]

  @property
  def num_experts(self) -> int:
    return self.expert_slot_LxE.shape[1]


def slots_per_device(num_experts: int, num_devices: int) -> int:
  if num_experts % num_devices:
    raise ConfigError(
        f"moe.num_experts={num_experts} is not divisible by the expert axis size "
        f"{num_devices}; choose E as a multiple of mesh.expert or change mesh.expert.")
  return num_experts // num_devices


def from_slot_expert(slot_expert_LxS: np.ndarray, num_experts: int) -> Layout:
  """Builds a one-copy-per-expert layout from its slot -> expert table (host side)."""
  slot_expert_LxS = np.asarray(slot_expert_LxS, dtype=np.int32)
  num_layers, num_slots = slot_expert_LxS.shape
  if num_slots != num_experts:
    raise ConfigError(f"an ep layout needs exactly one slot per expert: got {num_slots} slots "
                      f"for {num_experts} experts.")
  expert_slot_LxE = np.full((num_layers, num_experts), -1, np.int32)
  for layer in range(num_layers):
    row = slot_expert_LxS[layer]
    if sorted(row.tolist()) != list(range(num_experts)):
      raise ConfigError(f"layer {layer}: slot_expert {row.tolist()} is not a permutation of "
                        f"range({num_experts}).")
    expert_slot_LxE[layer, row] = np.arange(num_slots, dtype=np.int32)
  return Layout(jnp.asarray(slot_expert_LxS), jnp.asarray(expert_slot_LxE))


def static_layout(num_layers: int, num_experts: int, num_devices: int) -> Layout:
  """Expert e on device e // (E/N): slot s hosts expert s."""
  slots_per_device(num_experts, num_devices)
  slot_expert = np.tile(np.arange(num_experts, dtype=np.int32), (num_layers, 1))
  return from_slot_expert(slot_expert, num_experts)


def to_numpy(layout: Layout) -> dict[str, np.ndarray]:
  return {f.name: np.asarray(getattr(layout, f.name)) for f in dataclasses.fields(layout)}
