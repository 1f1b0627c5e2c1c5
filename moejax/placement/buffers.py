"""What a layout costs the compiled program: the buffer its dense dispatch must size and the
bytes its exchange moves, tallied over the steps a replay evaluates (numpy only).

The dense dispatch gives every (source, buffer) pair the same rows, a capacity factor times
the balanced share (`moejax.layout.capacity`), so the largest pairs decide it; its exchange
then moves every remote buffer whole, full or not. The ragged dispatch moves only the rows
that leave their device.
"""

from __future__ import annotations

import math

import numpy as np

from moejax.layout import adaptive, capacity, host_layout as placement_lib
from moejax.placement.layer_cost import CostModel

MAX_DROPPED = 0.01                  # the drop target the needed factor is for
TRANSFERS = 4                       # dispatch + combine, forward + backward


def slot_loads(p: placement_lib.Placement, counts_WxE: np.ndarray,
               src_dev_W: np.ndarray, mode: str = "slot") -> tuple[np.ndarray, np.ndarray] | None:
  """([W', S] rows each source sends each slot, the sources' devices [W']) as the layer
  routes them under the dense dispatch's capacity `mode` (adaptive shares keep a device's
  own rows within its buffer), or None for a rule without fixed per-source rows (shadow's
  local-first)."""
  counts = np.rint(np.asarray(counts_WxE)).astype(np.int64)
  n = p.num_devices
  if p.routing == "adaptive":
    dev_NxE = placement_lib.device_counts(counts, src_dev_W, n).astype(np.int64)
    return adaptive.split_adaptive(p, dev_NxE, adaptive.balanced_cap(dev_NxE, p),
                                   pooled=mode == "device"), np.arange(n)
  if p.routing == "split":
    return placement_lib.split_loads(p, counts, src_dev_W), np.asarray(src_dev_W)
  se = p.slot_expert
  if p.is_one_copy(counts.shape[1]):
    return np.where(se >= 0, counts[:, np.maximum(se, 0)], 0), np.asarray(src_dev_W)
  return None


class BufferTally:
  """Per capacity mode, the buffer loads of every (step, layer) a replay evaluates; then the
  smallest factor with at most MAX_DROPPED of all choices dropped, and the exchange's bytes."""

  def __init__(self, cost: CostModel):
    self.cost = cost
    self.loads = {mode: [] for mode in capacity.MODES}    # per (step, layer): [W, buffers]
    self.share = {mode: [] for mode in capacity.MODES}    # ... its balanced share of rows
    self.remote = {mode: [] for mode in capacity.MODES}   # ... remote buffers, all sources
    self.choices = 0
    self.crossing = 0
    self.known = True

  def add(self, p: placement_lib.Placement, counts_WxE: np.ndarray, src_dev_W: np.ndarray,
          crossing: int) -> None:
    self.crossing += crossing
    n, c = p.num_devices, p.slots_per_device
    # Only adaptive shares route by the capacity mode (a device keeps its own rows within the
    # buffer that mode sizes); the other rules route the same rows under both.
    if p.routing == "adaptive":
      routed = {mode: slot_loads(p, counts_WxE, src_dev_W, mode) for mode in capacity.MODES}
    else:
      routed = dict.fromkeys(capacity.MODES, slot_loads(p, counts_WxE, src_dev_W))
    if routed[capacity.MODES[0]] is None:
      self.known = False
      return
    self.choices += int(routed[capacity.MODES[0]][0].sum())
    for mode, (loads_WxS, src) in routed.items():
      per_source = float(loads_WxS.sum(1).max())
      buffers = capacity.buffers_per_source(mode, n, c)
      self.loads[mode].append(capacity.buffer_loads(mode, loads_WxS, c).ravel())
      self.share[mode].append(np.full(len(src) * buffers, per_source / buffers))
      self.remote[mode].append(len(src) * buffers * (n - 1) // n)

  def needed_factor(self, mode: str) -> float | None:
    """Smallest capacity factor at which all the tallied steps drop <= MAX_DROPPED of their
    choices together (bisection: drops fall as the factor grows)."""
    if not self.known or not self.loads[mode]:
      return None
    loads, share = np.concatenate(self.loads[mode]), np.concatenate(self.share[mode])
    allowed = math.floor(MAX_DROPPED * self.choices)

    def dropped(factor):
      return int(np.maximum(loads - np.maximum(np.ceil(factor * share), 1), 0).sum())

    lo, hi = 0.0, float((loads / share).max())
    for _ in range(40):
      mid = 0.5 * (lo + hi)
      lo, hi = (lo, mid) if dropped(mid) <= allowed else (mid, hi)
    return hi

  def exchange_bytes(self) -> dict:
    """Bytes the exchange moves over the tallied steps: per dense mode at its needed factor
    (every remote buffer whole), and for the ragged dispatch (the rows that cross)."""
    row = TRANSFERS * self.cost.row_bytes()
    out = {"ragged": self.crossing * row}
    for mode in capacity.MODES:
      factor = self.needed_factor(mode)
      out[mode] = None if factor is None else sum(
          r * max(1, math.ceil(factor * s[0])) * row
          for r, s in zip(self.remote[mode], self.share[mode]))
    return out

  def result(self) -> dict:
    return {"needed_capacity_factor": {m: self.needed_factor(m) for m in capacity.MODES},
            "exchange_bytes": self.exchange_bytes()}
