"""Online placement (dyn.X): observe finished steps' counts, re-plan every X steps, or, with
`planner.adaptive`, consider a re-plan after every finished step and switch a layer only when
its priced gain over X steps beats its migration (`moejax.placement.pricing`). Left unset,
adaptive is on where a switch moves no weights (fsep) and off where it does (`adaptive_for`).

Host-side and JAX-free. The trainer feeds it each finished step's count matrix
and asks, before dispatching step t, whether to switch layouts; the plan uses
only steps that had finished by then. The first plan comes as soon as one step
has finished (the initial layout knows nothing of the load), then every X steps.
The layout is shared by all data rows, so sources are folded onto their
expert-axis device first.
"""

from __future__ import annotations

import collections
import functools
import itertools
from typing import NamedTuple

import numpy as np

from moejax.config import PlannerConfig
from moejax.layout.flow import max_over_mean
from moejax.layout.host_layout import Placement
from moejax.placement import groups, policies, pricing
from moejax.placement.fsep.score import column_sums


def _whole(raw: np.ndarray, rows: int, steps: int) -> bool:
  """Whether counts `raw`, summed over `rows` data rows and then over `steps` + 1 steps in any
  order, add up exactly in float64: whole numbers small enough (for int32 counts, as the
  trainer's, by their type alone, without reading them)."""
  if raw.size == 0:
    return True
  bound = 2.0 ** 52 / (steps + 1) / max(rows, 1)
  if raw.dtype.kind in "biu":
    info = np.iinfo(raw.dtype) if raw.dtype.kind != "b" else np.iinfo(np.int8)
    if max(abs(int(info.min)), int(info.max)) < bound:
      return True
  elif not np.array_equal(raw, np.rint(raw)):
    return False
  return bool(raw.max() < bound and raw.min() > -bound)


def adaptive_for(cfg: PlannerConfig) -> bool:
  """Whether `cfg`'s re-planner is adaptive: planner.adaptive where set; unset (None), where a
  switch of the policy's layout moves no weights. There every new plan that the policy
  prefers is free, so planning after every step is what pays: a router that collapses in the
  first steps is followed within a step or two, not held on a plan of the near-uniform first
  step until the period's end. Where a switch moves weights (ep) the fixed period stays: the
  priced rule's gain there is a wash at GPU prices and its migrations are real time
  (docs/decisions/0110)."""
  if cfg.adaptive is not None:
    return cfg.adaptive
  return not pricing.moves_weights(cfg.policy)


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
               capacity_factor: float | None = None, capacity: str = "slot",
               num_groups: int = 1):
    """`cost`: the run's (moejax.strategy.placement_cost); `capacity_factor`: the dense
    dispatch's, so fsep plans count drops and keeps its own pairs' buffers (None for the
    dropless ragged dispatch); `capacity`: its mode (moe.capacity), 'device' makes smartmoe
    score placements by pooled drops; `num_groups`: moe.n_group, whose groups smartmoe keeps
    on their own devices (moejax.placement.groups)."""
    self.cfg = cfg
    self.adaptive = adaptive_for(cfg)
    self.capacity_factor = capacity_factor
    self.num_devices = num_devices
    self.cost = cost
    self.policy = policies.get_policy(cfg.policy)
    if cfg.policy == "smartmoe" and num_groups > 1:
      self.policy = functools.partial(groups.place_permutation, num_groups=num_groups)
    given = _config_options(cfg, capacity_factor, capacity)
    self.options = policies.make_options(cfg.policy, **given)
    # The window's steps, oldest first. An entry is never changed in place, so a `snapshot`
    # plans from the window as it was while this planner goes on observing.
    self.history: collections.deque = collections.deque(maxlen=cfg.window)
    # The window's sum, kept step by step so that a decision does not read the whole window
    # (84 MB per layer at N = 4096, E = 256). Added and taken off only while every step it
    # holds is whole counts (exact in float64, so it equals the sum of the window in order,
    # bit for bit); None: sum the window when asked.
    self._sum_LxNxE: np.ndarray | None = None
    self._sum_shared = False                # a snapshot holds it: add into a new array
    self._whole: tuple[bool, ...] = ()      # per step of the window: its counts are whole
    # fsep's spread planning reads each step's expert totals [steps, L, E]; kept per step as it
    # comes (None: the policy sums the steps itself).
    self._totals_stepsxLxE: np.ndarray | None = None
    # smartmoe scores drops per (source, device) buffer, and the program sizes one buffer per
    # data row: a row's overflow cannot use another row's room, so its samples keep the rows
    # of a device apart (summed, they would plan for buffers the program does not have).
    self.rows: collections.deque | None = (
        collections.deque(maxlen=cfg.window) if cfg.policy == "smartmoe" else None)
    self.planned = False             # a plan has been made (the cold start is over)

  def observe(self, counts_LxWxE: np.ndarray) -> None:
    """Counts of one finished step; sources ordered (data, expert) row-major."""
    raw = np.asarray(counts_LxWxE)
    c = raw.astype(np.float64, copy=False)
    layers, sources, experts = c.shape
    if sources % self.num_devices:   # another pool member's mesh: keep the expert totals
      folded_LxNxE = np.repeat(c.sum(1, keepdims=True) / self.num_devices, self.num_devices, 1)
    else:
      folded_LxNxE = c.reshape(layers, sources // self.num_devices, self.num_devices,
                               experts).sum(1)
    whole = not sources % self.num_devices and _whole(raw, sources // self.num_devices,
                                                       self.history.maxlen)
    self._append(folded_LxNxE, whole)
    if self.rows is not None:
      if sources % self.num_devices or (self.rows and self.rows[-1].shape != c.shape):
        self.rows.clear()   # another mesh's rows: sample from the folded history until refilled
      if not sources % self.num_devices:
        self.rows.append(c)

  def _append(self, folded_LxNxE: np.ndarray, whole: bool) -> None:
    """Appends one folded step to the window, its running sum and its expert totals."""
    full = len(self.history) == self.history.maxlen
    oldest = self.history[0] if full else None
    if not self.history:
      self._sum_LxNxE = folded_LxNxE.copy() if whole else None
      self._sum_shared = False
    elif self._sum_LxNxE is None or not whole or (full and not self._whole[0]):
      self._sum_LxNxE = None           # summed afresh when asked (`_window_sum`)
    else:
      if self._sum_shared:             # a snapshot holds the old array: add into a new one
        self._sum_LxNxE = self._sum_LxNxE + folded_LxNxE
        self._sum_shared = False
      else:
        self._sum_LxNxE += folded_LxNxE
      if oldest is not None:
        self._sum_LxNxE -= oldest
    self.history.append(folded_LxNxE)
    self._whole = (self._whole + (whole,))[-self.history.maxlen:]
    if self._tracks_totals():
      totals_1xLxE = np.stack([column_sums(np.ascontiguousarray(f, np.float64))
                               for f in folded_LxNxE])[None]
      kept = self._totals_stepsxLxE
      kept = kept[1:] if full and kept is not None else kept
      self._totals_stepsxLxE = (totals_1xLxE if kept is None
                                else np.concatenate([kept, totals_1xLxE]))

  def snapshot(self) -> OnlinePlanner:
    """A copy that later `observe` calls on this planner do not change (for planning on
    another thread): the window's deques are copied (their entries are never changed in
    place), and the running sum is shared from here on, so neither adds into it."""
    copied = object.__new__(type(self))
    copied.__dict__.update(self.__dict__)
    copied.history = collections.deque(self.history, maxlen=self.history.maxlen)
    if self.rows is not None:
      copied.rows = collections.deque(self.rows, maxlen=self.rows.maxlen)
    self._sum_shared = copied._sum_shared = True
    return copied

  def _tracks_totals(self) -> bool:
    return self.cfg.policy == "fsep" and getattr(self.options, "plan_for", "") == "spread"

  def _window_sum(self) -> np.ndarray:
    """[L, N, E]: the window's sum, added in order (as numpy's mean over the steps adds)."""
    if self._sum_LxNxE is not None:
      return self._sum_LxNxE
    total_LxNxE = self.history[0].copy()
    for h in itertools.islice(self.history, 1, None):
      total_LxNxE += h
    if all(self._whole):               # exact: kept from here on
      self._sum_LxNxE, self._sum_shared = total_LxNxE, False
    return total_LxNxE

  def clear(self) -> None:
    """Forgets every observed step."""
    self.history.clear()
    self._sum_LxNxE, self._whole, self._totals_stepsxLxE = None, (), None
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
    return self.adaptive or not self.planned or (step > 0 and step % self.every == 0)

  def propose(self, current: list[Placement]) -> tuple[list[Placement], list[Switch]]:
    """New placements per layer (the current one where no switch pays off; adaptive: also
    where the priced gain over `every` steps does not beat the migration)."""
    cold_start_done, self.planned = self.planned, True
    # policies.predict's mean of the window, from the running sum (the deque holds the window
    # only: maxlen is planner.window).
    pred_LxNxE = self._window_sum() / len(self.history)
    src = np.arange(self.num_devices)
    out, switches = list(current), []
    for layer, pred_NxE in enumerate(pred_LxNxE):
      cur = current[layer]
      new = self.policy(pred_NxE, cur, slots=cur.slots_per_device, src_dev_W=src,
                        cost=self.cost, num_devices=self.num_devices, options=self.options,
                        samples_stepsxWxE=self._samples(layer))
      # The cold-start plan is always taken (the initial layout knows nothing of the load).
      adaptive = self.adaptive and cold_start_done
      d = pricing.decide(cur, new, pred_NxE, self.cost, moves_weights=self._moves_weights,
                         horizon=self.every if adaptive else None,
                         totals_stepsxE=self._step_totals(layer) if adaptive else None)
      if d is None:
        continue
      out[layer] = new
      switches.append(Switch(layer, max_over_mean(d.load_before_N),
                             max_over_mean(d.load_after_N), d.price.moved, d.price.gain_s,
                             d.price.move_s, d.price.moved_bytes))
    return out, switches

  def _step_totals(self, layer: int) -> np.ndarray:
    """[steps, E]: each finished step's expert totals of `layer`, in the window."""
    if self._totals_stepsxLxE is not None:
      return self._totals_stepsxLxE[:, layer]
    return np.stack([h[layer].sum(0) for h in self.history])

  @property
  def _moves_weights(self) -> bool:
    return pricing.moves_weights(self.cfg.policy)

  def _samples(self, layer: int) -> np.ndarray | policies.Steps:
    """The window's steps of `layer`: the data rows where kept, else the folded steps; to
    fsep's spread planning, which reads only each step's expert totals, the folded steps as
    views with the totals kept as they came (stacked, they cost as much as the plan)."""
    if self.rows:
      return np.stack([r[layer] for r in self.rows])
    if self._totals_stepsxLxE is not None:
      return policies.Steps((h[layer] for h in self.history),
                            totals_stepsxE=self._totals_stepsxLxE[:, layer])
    return np.stack([h[layer] for h in self.history])

  def state_dict(self) -> dict:
    d = {"history": [h.tolist() for h in self.history], "planned": self.planned}
    if self.rows is not None:
      d["rows"] = [r.tolist() for r in self.rows]
    return d

  def load_state_dict(self, d: dict) -> None:
    self.clear()
    for h in d.get("history", []):
      h = np.asarray(h, np.float64)
      self._append(h, _whole(h, 1, self.history.maxlen))
    if self.rows is not None:   # a checkpoint without them samples the folded history
      for r in d.get("rows", []):
        self.rows.append(np.asarray(r, np.float64))
    # A checkpoint without the flag was written by a run that planned every X steps only.
    self.planned = bool(d.get("planned", len(self.history) > 0))
