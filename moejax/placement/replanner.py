"""Online placement (dyn.X): observe finished steps' counts, re-plan every X steps.

Host-side and JAX-free. The trainer feeds it each finished step's count matrix
and asks, before dispatching step t, whether to switch layouts; the plan uses
only steps that had finished by then. The layout is shared by all data rows, so
sources are folded onto their expert-axis device first.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from moejax.config import PlannerConfig
from moejax.layout import placement as placement_lib
from moejax.layout.flow import flow, max_over_mean
from moejax.layout.placement import Placement
from moejax.placement import policies


class Switch(NamedTuple):
  layer: int
  predicted_before: float      # predicted max/mean device load under the current layout
  predicted_after: float
  experts_moved: int           # (device, expert) copies the new layout adds


def _config_options(cfg: PlannerConfig, capacity_factor: float | None, capacity: str) -> dict:
  """The policy options the config sets: smartmoe's hysteresis and, under pooled capacity,
  the factor its drops are scored at; fsep's dense capacity, spread planning and locality."""
  if cfg.policy == "smartmoe":
    pooled = capacity_factor if capacity == "device" and capacity_factor else 0.0
    return {"min_gain": cfg.min_gain, "pooled_capacity_factor": pooled}
  if cfg.policy == "fsep":
    return {"capacity_factor": capacity_factor, "plan_for": cfg.fsep_plan_for,
            "locality": cfg.fsep_locality}
  return {}


class OnlinePlanner:
  def __init__(self, cfg: PlannerConfig, num_devices: int, cost: policies.CostModel | None = None,
               capacity_factor: float | None = None, capacity: str = "slot"):
    """`capacity_factor`: the dense dispatch's, so fsep plans count per-slot drops (None for
    the dropless ragged dispatch); `capacity`: its mode (moe.capacity), 'device' makes
    smartmoe score placements by pooled drops."""
    self.cfg = cfg
    self.capacity_factor = capacity_factor
    self.num_devices = num_devices
    self.cost = cost or policies.CostModel()
    self.policy = policies.get_policy(cfg.policy)
    given = _config_options(cfg, capacity_factor, capacity)
    self.options = policies.make_options(cfg.policy, **given)
    self.history: collections.deque = collections.deque(maxlen=cfg.window)

  def observe(self, counts_LxWxE: np.ndarray) -> None:
    """Counts of one finished step; sources ordered (data, expert) row-major."""
    c = np.asarray(counts_LxWxE, np.float64)
    layers, sources, experts = c.shape
    if sources % self.num_devices:   # another pool member's mesh: keep the expert totals
      folded_LxNxE = np.repeat(c.sum(1, keepdims=True) / self.num_devices, self.num_devices, 1)
    else:
      folded_LxNxE = c.reshape(layers, sources // self.num_devices, self.num_devices,
                               experts).sum(1)
    self.history.append(folded_LxNxE)

  @property
  def active(self) -> bool:
    return self.cfg.policy != "static"

  @property
  def every(self) -> int:
    """Re-plan period: `fsep_every` for the fsep re-planner when set, else `every`."""
    if self.cfg.policy == "fsep" and self.cfg.fsep_every > 0:
      return self.cfg.fsep_every
    return self.cfg.every

  def due(self, step: int) -> bool:
    return (self.active and self.every > 0 and step > 0 and
            step % self.every == 0 and len(self.history) > 0)

  def propose(self, current: list[Placement]) -> tuple[list[Placement], list[Switch]]:
    """New placements per layer (the current one where no switch pays off)."""
    history_stepsxLxNxE = np.stack(self.history)[-self.cfg.window:]
    pred_LxNxE = policies.predict(history_stepsxLxNxE, self.cfg.window)
    src = np.arange(self.num_devices)
    out, switches = list(current), []
    for layer, pred_NxE in enumerate(pred_LxNxE):
      cur = current[layer]
      new = self.policy(pred_NxE, cur, slots=cur.slots_per_device, src_dev_W=src,
                        cost=self.cost, num_devices=self.num_devices, options=self.options,
                        samples_stepsxWxE=history_stepsxLxNxE[:, layer])
      if (np.array_equal(new.slot_expert, cur.slot_expert) and
          np.allclose(new.share, cur.share, atol=0.5 / placement_lib.SHARE_PARTS) and
          np.array_equal(placement_lib.local_parts(new), placement_lib.local_parts(cur))):
        continue
      experts = pred_NxE.shape[1]
      before = max_over_mean(flow(cur, pred_NxE, src).device_load_N)
      after = max_over_mean(flow(new, pred_NxE, src).device_load_N)
      added_NxE = placement_lib.presence(new, experts) & ~placement_lib.presence(cur, experts)
      moved = int(added_NxE.sum())
      out[layer] = new
      switches.append(Switch(layer, before, after, moved))
    return out, switches

  def state_dict(self) -> dict:
    return {"history": [h.tolist() for h in self.history]}

  def load_state_dict(self, d: dict) -> None:
    self.history.clear()
    for h in d.get("history", []):
      self.history.append(np.asarray(h, np.float64))
