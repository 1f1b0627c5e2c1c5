"""Placement under group-limited routing: each expert group keeps to its own devices.

DeepSeek-V3 routes a token to at most `topk_group` of `n_group` groups of contiguous expert
ids (`moejax.model.moe.route.group_mask`), and places group g on node g, so that a token's
rows reach at most `topk_group` nodes. The routing itself never reads the layout: a planner
free to move any expert anywhere keeps the model's outputs but spreads each group over more
devices, and a token's rows then reach more devices than its groups. So, for the one-copy
planner (smartmoe) the layer is planned as independent smaller problems:

- `n_group` divides the N devices: group g owns devices [g N/G, (g + 1) N/G) (where the static
  layout puts it) and its E/G experts are planned over those devices alone, each block its own
  problem with its own hysteresis; a token's rows reach at most topk_group x N/G devices.
- N divides `n_group`: a device holds G/N whole groups, and the groups (loads summed) are
  placed as if each were one expert; a token's rows reach at most topk_group devices.
- neither: groups already straddle devices in the static layout; nothing is kept.

Pooled capacity's buffers are sized from a source's choices to all experts, so a block's
problem gets the whole layer's buffer rows (`cap_stepsxW`), not its own experts' share.
fsep's planner is not constrained: its tokens follow the replicas' shares to any device
holding one (docs/decisions/0037's limit applies to groups too).
"""

from __future__ import annotations

import numpy as np

from moejax.layout import host_layout as placement_lib
from moejax.placement import smartmoe


def kept(num_experts: int, num_groups: int, num_devices: int) -> str:
  """'blocks' (groups own N/G devices each), 'whole' (devices hold whole groups) or '' (no
  constraint: one group, or groups and devices that do not divide each other)."""
  if num_groups <= 1 or num_experts % num_groups:
    return ""
  if num_devices % num_groups == 0:
    return "blocks"
  if num_groups % num_devices == 0:
    return "whole"
  return ""


def respects(placement: placement_lib.Placement, num_experts: int, num_groups: int) -> bool:
  """Whether every group's experts sit where `kept` keeps them (one copy each)."""
  n = placement.num_devices
  how = kept(num_experts, num_groups, n)
  if not how:
    return True
  if not placement.is_one_copy(num_experts):
    return False
  group_N_C = placement.slot_expert.reshape(n, -1) // (num_experts // num_groups)
  if how == "blocks":
    return bool(np.all(group_N_C == (np.arange(n) // (n // num_groups))[:, None]))
  counts = np.stack([np.bincount(row, minlength=num_groups) for row in group_N_C])
  return bool(np.all((counts == 0) | (counts == num_experts // num_groups)))


def place_permutation(pred_WxE: np.ndarray, current: placement_lib.Placement, *,
                      num_groups: int, options: smartmoe.SmartMoEOptions | None = None,
                      samples_stepsxWxE: np.ndarray | None = None,
                      **shared) -> placement_lib.Placement:
  """smartmoe's permutation with each group kept on its devices (see the module doc)."""
  options = options or smartmoe.SmartMoEOptions()
  pred_WxE = np.asarray(pred_WxE, np.float64)
  num_experts, n = pred_WxE.shape[1], current.num_devices
  how = kept(num_experts, num_groups, n)
  if not how:
    return smartmoe.place_permutation(pred_WxE, current, options=options,
                                      samples_stepsxWxE=samples_stepsxWxE, **shared)
  if not respects(current, num_experts, num_groups):
    current = placement_lib.static(num_experts, n)
  per = num_experts // num_groups
  cap = None
  pooled = options.pooled_capacity_factor > 0 and samples_stepsxWxE is not None
  if pooled:
    samples = np.asarray(samples_stepsxWxE, np.float64)
    cap = np.ceil(options.pooled_capacity_factor * samples.sum(-1) / n)
  if how == "whole":   # groups as experts: load summed, the whole layer's buffers
    group_of = lambda x: x.reshape(x.shape[:-1] + (num_groups, per)).sum(-1)
    group_N_C = current.slot_expert.reshape(n, -1) // per
    now = placement_lib.one_copy(np.concatenate([np.unique(row) for row in group_N_C]), n)
    plan = smartmoe.place_permutation(group_of(pred_WxE), now, options=options,
                                      samples_stepsxWxE=group_of(samples) if pooled else None,
                                      cap_stepsxW=cap)
    if plan is now:
      return current
    dev_E = np.repeat(plan.device_of_slot[np.argsort(plan.slot_expert)], per)
    return placement_lib.one_copy(smartmoe._to_slots(dev_E, current, num_experts // n), n)
  devices = n // num_groups                    # blocks: each group over its own devices
  slot_expert = current.slot_expert.copy()
  slots = len(slot_expert) // num_groups
  moved = False
  for g in range(num_groups):
    experts, block = slice(g * per, (g + 1) * per), slice(g * slots, (g + 1) * slots)
    now = placement_lib.one_copy(current.slot_expert[block] - g * per, devices)
    plan = smartmoe.place_permutation(
        pred_WxE[:, experts], now, options=options,
        samples_stepsxWxE=samples[..., experts] if pooled else None, cap_stepsxW=cap)
    if plan is not now:
      slot_expert[block] = plan.slot_expert + g * per
      moved = True
  return placement_lib.one_copy(slot_expert, n) if moved else current
