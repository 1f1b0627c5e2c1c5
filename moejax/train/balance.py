"""What the run's expert placement bought: its drops and realised load beside the static
layout's on the same routed counts.

Drops depend only on how many choices each buffer receives (moejax.layout.capacity), so the
static layout's drops and realised work follow from each step's logged counts without
running it. The comparison uses the steps of the run's second half, after the re-planner has
had its first steps to observe.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.layout import capacity, host_layout as placement_lib
from moejax.layout.flow import max_over_mean
from moejax.train.controllers import Hook


@dataclasses.dataclass
class Tally:
  choices: int = 0
  dropped: int = 0
  static_dropped: int = 0
  max_over_mean: list = dataclasses.field(default_factory=list)
  static_max_over_mean: list = dataclasses.field(default_factory=list)


def static_counterfactual(counts_WxE: np.ndarray, num_devices: int, mode: str, top_k: int,
                          capacity_factor: float) -> tuple[int, float]:
  """(dropped choices, realised max/mean device work) of one MoE layer's step under the
  static layout (expert e on device e // (E/N), one copy) with the same capacity rule.
  Sources are ordered (data row, expert device), as in the step's metrics."""
  counts_WxE = np.asarray(counts_WxE, np.int64)
  num_experts = counts_WxE.shape[1]
  slots = num_experts // num_devices
  loads_WxS = placement_lib.split_loads(
      placement_lib.static(num_experts, num_devices), counts_WxE,
      np.arange(len(counts_WxE)) % num_devices)     # source (row, d) runs on device d
  num_tokens = int(counts_WxE.sum(1).max()) // top_k
  cap = capacity.rows(mode, num_tokens, top_k, num_devices, slots, capacity_factor)
  rows_per_data_row = [
      capacity.computed_by_device(mode, loads_WxS[r:r + num_devices], slots, cap)
      for r in range(0, len(loads_WxS), num_devices)]
  work = np.concatenate(rows_per_data_row)
  return capacity.dropped(mode, loads_WxS, slots, cap), max_over_mean(work)


class BalanceTally(Hook):
  """Counts the run's drops and realised max/mean and the static layout's, per MoE layer and
  step, over the steps from `from_step` on."""

  def __init__(self, from_step: int):
    self.from_step = from_step
    self.tally = Tally()

  def after_metrics(self, trainer, step, record, counts_LxWxE, member) -> None:
    if step < self.from_step:
      return
    prog = trainer.pool.programs[member]
    moe, n = prog.cfg.moe, prog.mesh.shape["expert"]
    if moe.dispatch != "dense" or moe.num_experts % n:
      return   # ragged drops nothing by design; a static layout needs E divisible by N
    t = self.tally
    for layer, rec in zip(np.asarray(counts_LxWxE), record["moe"]):
      choices = int(layer.sum())
      t.choices += choices
      t.dropped += round(rec["dropped_fraction"] * choices)
      static_dropped, static_mom = static_counterfactual(layer, n, moe.capacity, moe.top_k,
                                                         moe.capacity_factor)
      t.static_dropped += static_dropped
      t.static_max_over_mean.append(static_mom)
      if "realised_max_over_mean" in rec:
        t.max_over_mean.append(rec["realised_max_over_mean"])

  def summary(self) -> dict | None:
    """None when no step was counted."""
    t = self.tally
    if not t.choices or not t.max_over_mean:
      return None
    return {"from_step": self.from_step,
            "dropped_fraction": t.dropped / t.choices,
            "static_dropped_fraction": t.static_dropped / t.choices,
            "realised_max_over_mean": float(np.mean(t.max_over_mean)),
            "static_realised_max_over_mean": float(np.mean(t.static_max_over_mean))}


def describe(summary: dict, policy: str, mode: str) -> str:
  """The one line train.py ends with."""
  return (f"balance from step {summary['from_step']} ({policy} placement, capacity per "
          f"{mode}): dropped {summary['dropped_fraction']:.2%} of choices vs "
          f"{summary['static_dropped_fraction']:.2%} under the static layout; realised "
          f"max/mean device work {summary['realised_max_over_mean']:.3f} vs "
          f"{summary['static_realised_max_over_mean']:.3f}")
