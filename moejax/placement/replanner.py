"""Online placement (dyn.X): observe finished steps' counts, re-plan every X steps, or, with
`planner.adaptive`, consider a re-plan after every finished step and switch a layer only when
its priced gain over X steps beats its migration (`moejax.placement.pricing`).

Host-side and JAX-free. The trainer feeds it each finished step's count matrix
and asks, before dispatching step t, whether to switch layouts; the plan uses
only steps that had finished by then. The first plan comes as soon as one step
has finished (the initial layout knows nothing of the load), then every X steps.
The layout is shared by all data rows, so sources are folded onto their
expert-axis device first.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from moejax.config import PlannerConfig
from moejax.layout import placement as placement_lib
from moejax.layout.flow import max_over_mean
from moejax.layout.placement import Placement
from moejax.placement import policies, pricing
from moejax.placement.pricing import planned_load as _planned_load


class Switch(NamedTuple):
  layer: int
  predicted_before: float      # predicted max/mean device load under the current layout
  predicted_after: float
  experts_moved: int           # (device, expert) copies the new layout adds
  gain_s: float = 0.0          # predicted seconds a step saves (the busiest device's compute)
  move_s: float = 0.0          # the migration's priced seconds
  moved_bytes: int = 0         # weight and Adam-moment bytes the migration carries


def _config_options(cfg: PlannerConfig, capacity_factor: float | None, capacity: str) -> dict:
  """The policy options the config sets: smartmoe's hysteresis and, under pooled capacity,
  the factor its drops are scored at; fsep's dense capacity (factor and mode), spread
  planning and locality."""
  if cfg.policy == "smartmoe":
    pooled = capacity_factor if capacity == "device" and capacity_factor else 0.0
    return {"min_gain": cfg.min_gain, "pooled_capacity_factor": pooled}
  if cfg.policy == "fsep":
    return {"capacity_factor": capacity_factor, "capacity": capacity,
            "plan_for": cfg.fsep_plan_for, "locality": cfg.fsep_locality}
  return {}


class OnlinePlanner:
  def __init__(self, cfg: PlannerConfig, num_devices: int, cost: policies.CostModel,
               capacity_factor: float | None = None, capacity: str = "slot"):
    """`cost`: the run's (moejax.strategy.placement_cost); `capacity_factor`: the dense
    dispatch's, so fsep plans count drops and keeps its own pairs' buffers (None for the
    dropless ragged dispatch); `capacity`: its mode (moe.capacity), 'device' makes smartmoe
    score placements by pooled drops."""
    self.cfg = cfg
    self.capacity_factor = capacity_factor
    self.num_devices = num_devices
    self.cost = cost
    self.policy = policies.get_policy(cfg.policy)
    given = _config_options(cfg, capacity_factor, capacity)
    self.options = policies.make_options(cfg.policy, **given)
    self.history: collections.deque = collections.deque(maxlen=cfg.window)
    # smartmoe scores drops per (source, device) buffer, and the program sizes one buffer per
    # data row: a row's overflow cannot use another row's room, so its samples keep the rows
    # of a device apart (summed, they would plan for buffers the program does not have).
    self.rows: collections.deque | None = (
        collections.deque(maxlen=cfg.window) if cfg.policy == "smartmoe" else None)
    self.planned = False             # a plan has been made (the cold start is over)

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
    if self.rows is not None:
      if sources % self.num_devices or (self.rows and self.rows[-1].shape != c.shape):
        self.rows.clear()   # another mesh's rows: sample from the folded history until refilled
      if not sources % self.num_devices:
        self.rows.append(c)

  def clear(self) -> None:
    """Forgets every observed step."""
    self.history.clear()
    if self.rows is not None:
      self.rows.clear()

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
    """Re-plan before `step`: at the first step with a finished one to plan from, then every
    `every` steps; adaptive: before every step with a finished one (`propose` then keeps the
    layers whose switch does not pay)."""
    if not (self.active and self.every > 0 and len(self.history) > 0):
      return False
    return self.cfg.adaptive or not self.planned or (step > 0 and step % self.every == 0)

  def propose(self, current: list[Placement]) -> tuple[list[Placement], list[Switch]]:
    """New placements per layer (the current one where no switch pays off; adaptive: also
    where the priced gain over `every` steps does not beat the migration)."""
    cold_start_done, self.planned = self.planned, True
    history_stepsxLxNxE = np.stack(self.history)[-self.cfg.window:]
    pred_LxNxE = policies.predict(history_stepsxLxNxE, self.cfg.window)
    src = np.arange(self.num_devices)
    samples_stepsxLxWxE = (np.stack(self.rows)[-self.cfg.window:] if self.rows
                           else history_stepsxLxNxE)
    out, switches = list(current), []
    for layer, pred_NxE in enumerate(pred_LxNxE):
      cur = current[layer]
      new = self.policy(pred_NxE, cur, slots=cur.slots_per_device, src_dev_W=src,
                        cost=self.cost, num_devices=self.num_devices, options=self.options,
                        samples_stepsxWxE=samples_stepsxLxWxE[:, layer])
      if (np.array_equal(new.slot_expert, cur.slot_expert) and
          np.allclose(new.share, cur.share, atol=0.5 / placement_lib.SHARE_PARTS) and
          np.array_equal(placement_lib.local_parts(new), placement_lib.local_parts(cur))):
        continue
      load_before_N, load_after_N = _planned_load(cur, pred_NxE), _planned_load(new, pred_NxE)
      priced = pricing.price(cur, new, load_before_N, load_after_N, self.cost, pred_NxE.shape[1],
                             moves_weights=self.cfg.policy not in pricing.FREE_MOVE_POLICIES)
      # The cold-start plan is always taken (the initial layout knows nothing of the load).
      if self.cfg.adaptive and cold_start_done and not priced.pays(self.every):
        continue
      out[layer] = new
      switches.append(Switch(layer, max_over_mean(load_before_N), max_over_mean(load_after_N),
                             priced.moved, priced.gain_s, priced.move_s, priced.moved_bytes))
    return out, switches

  def state_dict(self) -> dict:
    d = {"history": [h.tolist() for h in self.history], "planned": self.planned}
    if self.rows is not None:
      d["rows"] = [r.tolist() for r in self.rows]
    return d

  def load_state_dict(self, d: dict) -> None:
    self.history.clear()
    for h in d.get("history", []):
      self.history.append(np.asarray(h, np.float64))
    if self.rows is not None:   # a checkpoint without them samples the folded history
      self.rows.clear()
      for r in d.get("rows", []):
        self.rows.append(np.asarray(r, np.float64))
    # A checkpoint without the flag was written by a run that planned every X steps only.
    self.planned = bool(d.get("planned", len(self.history) > 0))
