"""FasterMoE-style shadow experts on top of the static placement.

The hottest experts are replicated to every device ("shadowed") so each source
computes its own tokens for them locally, one expert at a time, while the cost
model says the step gets faster (compute of the busiest device + exchange, less
the per-step weight broadcast and gradient reduction of the shadows). Each
device holds the static E/N experts plus up to (slots - E/N) shadows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.layout import host_layout as placement_lib
from moejax.layout.flow import flow
from moejax.placement.layer_cost import CostModel


def _with_shadows(shadowed: list[int], base: placement_lib.Placement, dev_counts_NxE: np.ndarray,
                  slots: int) -> placement_lib.Placement:
  n, c0 = base.num_devices, base.slots_per_device
  se = np.full((n, slots), -1, np.int32)
  share = np.zeros((n, slots))
  se[:, :c0] = base.slot_expert.reshape(n, c0)
  share[:, :c0] = base.share.reshape(n, c0)
  totals = dev_counts_NxE.sum(0)
  for j, e in enumerate(shadowed):
    frac_N = dev_counts_NxE[:, e] / totals[e] if totals[e] > 0 else np.full(n, 1.0 / n)
    home = int(np.flatnonzero(base.slot_expert == e)[0])
    d0 = home // c0
    share[d0, home % c0] = frac_N[d0]
    for d in range(n):
      if d != d0:
        se[d, c0 + j] = e
        share[d, c0 + j] = frac_N[d]
  return placement_lib.Placement(se.reshape(-1), share.reshape(-1), n)


@dataclasses.dataclass(frozen=True)
class ShadowOptions:
  """Shadowing has no options: the cost model decides how many experts to shadow."""


def place_shadows(pred_WxE: np.ndarray, current: placement_lib.Placement, *, slots: int,
                  src_dev_W: np.ndarray, cost: CostModel, num_devices: int | None = None,
                  options: ShadowOptions = ShadowOptions(),
                  samples_stepsxWxE: np.ndarray | None = None) -> placement_lib.Placement:
  """The static layout plus the shadows that pay off (see the module doc)."""
  del samples_stepsxWxE
  pred_WxE = np.asarray(pred_WxE, np.float64)
  num_experts, n = pred_WxE.shape[1], current.num_devices
  base = placement_lib.static(num_experts, n)
  extra = slots - base.slots_per_device
  dev_counts = placement_lib.device_counts(pred_WxE, src_dev_W, n)

  def step_time(shadowed):
    p = _with_shadows(shadowed, base, dev_counts, base.slots_per_device + max(extra, 0))
    f = flow(p, pred_WxE, src_dev_W)
    return cost.step_s(f.device_load_N, f.sent_N, replicas_per_device=len(shadowed)), p

  best_t, best = step_time([])
  shadowed: list[int] = []
  for e in np.argsort(-pred_WxE.sum(0), kind="stable")[:max(extra, 0)]:
    t, p = step_time(shadowed + [int(e)])
    if t >= best_t:
      break
    best_t, best, shadowed = t, p, shadowed + [int(e)]
  return best
