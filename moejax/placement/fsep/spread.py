"""Planning for the spread of the recent loads, not only their mean (numpy only).

A lagged fsep layout is used for steps whose loads differ from the window it was planned from:
per-step noise, drift, bursts. With `FsepOptions.plan_for = 'spread'` the planner gets the
window's steps themselves and
  - adds candidate replica counts apportioned to the window's last step (a burst still under
    way) and to mean + one standard deviation per expert (hedging replicas for the experts
    whose load varies most), beside those for the mean;
  - scores every candidate by the mean over the window's steps of its busiest device's load
    on that step (each step scaled to the mean's total), instead of on the mean load alone;
  - with `center='median'`, levels on each expert's median share over the window's last
    `center_steps` steps (`recent_center`) instead of its mean share over the window: per-step
    noise is heavy-tailed (a few experts jump by 15% or more on any step), and one such step
    moves a mean of 10 by 1.5%; the median ignores it and follows a drift or a burst sooner.
    Only the expert totals move: each expert's split over the sources stays the window mean's.
On a steady load the plan is today's.
"""

from __future__ import annotations

import numpy as np

from moejax.placement.fsep.score import column_sums


def step_totals(samples_stepsxWxE: np.ndarray) -> np.ndarray:
  """[steps, E]: each finished step's expert totals over the sources, read once for both
  `window_loads` and `recent_center` (at N = 4096, E = 256 the window is 84 MB of float64:
  reading it sets their time). Summed step by step, each [W, E] block with `column_sums`;
  the steps may be a list of [W, E] arrays, and one that carries `totals_stepsxE`
  (moejax.placement.policies.Steps, from the re-planner that kept them) is not read again."""
  totals_stepsxE = getattr(samples_stepsxWxE, "totals_stepsxE", None)
  if totals_stepsxE is not None:
    return totals_stepsxE
  return np.stack([column_sums(np.ascontiguousarray(x, np.float64)) for x in samples_stepsxWxE])


def window_loads(totals_stepsxE: np.ndarray, total: float) -> np.ndarray:
  """[steps, E]: each finished step's expert loads (`step_totals`), scaled to `total` tokens
  (how its sources sit on devices does not change an expert's total)."""
  return totals_stepsxE * (total / np.maximum(totals_stepsxE.sum(1, keepdims=True), 1e-12))


def recent_center(pred_WxE: np.ndarray, totals_stepsxE: np.ndarray, steps: int) -> np.ndarray:
  """pred_WxE with each expert's total set to its median share over the last `steps` steps
  (`step_totals`, renormalised to sum to 1) times pred's total; each expert's split over
  sources is kept."""
  load_stepsxE = totals_stepsxE[-steps:]
  share_stepsxE = load_stepsxE / np.maximum(load_stepsxE.sum(1, keepdims=True), 1e-12)
  med_E = np.median(share_stepsxE, axis=0)
  load_E = column_sums(pred_WxE)
  if med_E.sum() <= 0 or load_E.sum() <= 0:
    return pred_WxE
  want_E = med_E / med_E.sum() * load_E.sum()
  return pred_WxE * np.where(load_E > 0, want_E / np.maximum(load_E, 1e-300), 0.0)[None]


def hedge_loads(load_stepsxE: np.ndarray) -> list[np.ndarray]:
  """Load vectors to apportion replicas to besides the mean: the last step, mean + std."""
  return [load_stepsxE[-1], load_stepsxE.mean(0) + load_stepsxE.std(0)]


def mean_peak(grid: np.ndarray, share: np.ndarray, load_stepsxE: np.ndarray) -> np.ndarray:
  """[cands]: the busiest device's load, averaged over the window's steps, for the replicas
  grid[cands, N, rounds] with shares share[cands, N, rounds]."""
  quota_stepsxcandsxNxR = share[None] * load_stepsxE[:, grid]
  return np.einsum("zknr->zkn", quota_stepsxcandsxNxR).max(2).mean(0)
