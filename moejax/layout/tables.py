"""Expert layouts: which expert each slot hosts and how tokens split over replicas.

A layout is *data* fed to the step: small int32 arrays with a leading MoE-layer
axis. A device on the expert axis owns `C` consecutive slots; slot `s` lives on
device `s // C`. Each expert lists its replica slots (in slot order, -1 padded
to a static R) and their token shares in integer parts of SHARE_PARTS; each slot also holds
the parts of its own device's tokens it keeps before that split (per-source shares, fsep).

- `ep` layouts have R = 1: one copy per expert, and the slot physically owns the
  expert's weights (stored in slot order `[layers, N*C, ...]`).
- `fsep` layouts have R = N: up to one replica of an expert per device; weights
  are stored sharded in expert order and restored per step by `slot_expert`.
Changing a layout changes only these arrays, never the compiled program.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ConfigError
from moejax.layout import host_layout as placement_lib


@flax.struct.dataclass
class Layout:
  slot_expert_LxS: jax.Array       # int32 [layers, N*C]: expert hosted by each slot (-1: none)
  expert_slots_LxExR: jax.Array    # int32 [layers, E, R]: replica slots, ascending, -1 padded
  expert_parts_LxExR: jax.Array    # int32 [layers, E, R]: token share parts, sum SHARE_PARTS
  # int32 [layers, N*C]: parts (of SHARE_PARTS) of the hosting device's own tokens for the
  # slot's expert kept on the slot before the rest is split by expert_parts; zeros: none.
  slot_local_parts_LxS: jax.Array
  # float32 [layers, E]: added to router probabilities when choosing experts (not to the
  # gates); zeros = plain top-k. Data like the rest: a planner (or a load-injection
  # benchmark) may change it every step without recompiling.
  router_bias_LxE: jax.Array

  @property
  def expert_slot_LxE(self) -> jax.Array:
    """The first replica of each expert (the only one in ep layouts)."""
    return self.expert_slots_LxExR[..., 0]

  @property
  def num_slots(self) -> int:
    return self.slot_expert_LxS.shape[-1]


def slots_per_device(num_experts: int, num_devices: int) -> int:
  """ep mode: exactly E/N slots per device."""
  if num_experts % num_devices:
    raise ConfigError(
        f"moe.num_experts={num_experts} is not divisible by the expert axis size "
        f"{num_devices}; choose E as a multiple of mesh.expert or change mesh.expert.")
  return num_experts // num_devices


def from_placements(placements: Sequence[placement_lib.Placement], num_experts: int,
                    max_replicas: int, router_bias_LxE: np.ndarray | None = None) -> Layout:
  """Host placements (one per MoE layer) -> a device Layout with R = max_replicas (router
  bias zeros unless given)."""
  layers = len(placements)
  num_slots = len(placements[0].slot_expert)
  slot_expert = np.full((layers, num_slots), -1, np.int32)
  slots = np.full((layers, num_experts, max_replicas), -1, np.int32)
  parts = np.zeros((layers, num_experts, max_replicas), np.int32)
  local = np.zeros((layers, num_slots), np.int32)
  for layer, p in enumerate(placements):
    p.validate(num_experts)
    reps = p.replicas(num_experts)
    if reps.max() > max_replicas:
      raise ConfigError(f"layer {layer}: expert {int(reps.argmax())} has {int(reps.max())} "
                        f"replicas but this strategy allows {max_replicas}.")
    slot_expert[layer] = p.slot_expert
    local[layer] = placement_lib.local_parts(p)
    share_parts = placement_lib.share_parts(p, num_experts)
    for e in range(num_experts):
      mine = np.flatnonzero(p.slot_expert == e)
      slots[layer, e, :len(mine)] = mine
      parts[layer, e, :len(mine)] = share_parts[mine]
  if router_bias_LxE is None:
    router_bias_LxE = np.zeros((layers, num_experts), np.float32)
  bias = np.asarray(router_bias_LxE, np.float32)
  if bias.shape != (layers, num_experts):
    raise ConfigError(f"router bias has shape {bias.shape}; it must be [layers={layers}, "
                      f"experts={num_experts}].")
  return Layout(jnp.asarray(slot_expert), jnp.asarray(slots), jnp.asarray(parts),
                jnp.asarray(local), jnp.asarray(bias))


def to_placements(layout: Layout, num_devices: int) -> list[placement_lib.Placement]:
  """Device Layout -> host placements (shares as exact fractions of SHARE_PARTS)."""
  slot_expert = np.asarray(layout.slot_expert_LxS)
  slots, parts = np.asarray(layout.expert_slots_LxExR), np.asarray(layout.expert_parts_LxExR)
  local = np.asarray(layout.slot_local_parts_LxS)
  out = []
  for layer in range(slot_expert.shape[0]):
    share = np.zeros(slot_expert.shape[1])
    ok = slots[layer] >= 0
    share[slots[layer][ok]] = parts[layer][ok] / placement_lib.SHARE_PARTS
    routing = "split" if slots.shape[-1] > 1 else "local_first"   # what the device does
    kept = (local[layer] / placement_lib.SHARE_PARTS
            if routing == "split" and local[layer].any() else None)
    out.append(placement_lib.Placement(slot_expert[layer].copy(), share, num_devices, routing,
                                       kept))
  return out


def from_slot_expert(slot_expert_LxS: np.ndarray, num_experts: int) -> Layout:
  """A one-copy-per-expert (ep) layout from its slot -> expert table (host side)."""
  slot_expert_LxS = np.asarray(slot_expert_LxS, dtype=np.int32)
  num_layers, num_slots = slot_expert_LxS.shape
  if num_slots != num_experts:
    raise ConfigError(f"an ep layout needs exactly one slot per expert: got {num_slots} slots "
                      f"for {num_experts} experts.")
  for layer in range(num_layers):
    row = slot_expert_LxS[layer]
    if sorted(row.tolist()) != list(range(num_experts)):
      raise ConfigError(f"layer {layer}: slot_expert {row.tolist()} is not a permutation of "
                        f"range({num_experts}).")
  placements = [placement_lib.one_copy(row, 1) for row in slot_expert_LxS]
  return from_placements(placements, num_experts, 1)


def static_layout(num_layers: int, num_experts: int, num_devices: int) -> Layout:
  """ep: expert e on device e // (E/N): slot s hosts expert s."""
  slots_per_device(num_experts, num_devices)
  slot_expert = np.tile(np.arange(num_experts, dtype=np.int32), (num_layers, 1))
  return from_slot_expert(slot_expert, num_experts)


def fsep_slots_check(num_experts: int, num_devices: int, slots: int) -> None:
  if num_devices * slots < num_experts:
    raise ConfigError(
        f"fsep needs N*C >= E: mesh.expert={num_devices} x moe.slots_per_device={slots} < "
        f"moe.num_experts={num_experts}; raise moe.slots_per_device to at least "
        f"{-(-num_experts // num_devices)}.")
  if slots > num_experts:
    raise ConfigError(f"moe.slots_per_device={slots} exceeds moe.num_experts={num_experts}; a "
                      "device holds at most one replica of each expert.")


def round_robin_placement(num_experts: int, num_devices: int,
                          slots: int) -> placement_lib.Placement:
  """fsep start layout: slot s hosts expert s mod E; replicas split tokens evenly."""
  fsep_slots_check(num_experts, num_devices, slots)
  slot_expert = np.arange(num_devices * slots, dtype=np.int32) % num_experts
  reps = np.bincount(slot_expert, minlength=num_experts)
  return placement_lib.Placement(slot_expert, 1.0 / reps[slot_expert], num_devices, routing="split")


def round_robin_layout(num_layers: int, num_experts: int, num_devices: int,
                       slots: int) -> Layout:
  p = round_robin_placement(num_experts, num_devices, slots)
  return from_placements([p] * num_layers, num_experts, num_devices)
