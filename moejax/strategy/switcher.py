"""Online stage: pick the pool member to run next from the load of finished steps.

Host-side and JAX-free. Every `strategy.every` steps the trainer hands over the expert shares
of the last finished steps and the share of choices they really dropped; each member's step
time and dropped share are predicted under that load (moejax.strategy.cost), with the spread
of a source's count per expert measured from the same steps (real batches cluster: a sequence
repeats its tokens).

How remembered excess drops and the switch rule work: `StrategySwitcher`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import StrategyConfig
from moejax.strategy.cost import HardwareProfile, StepCost, Workload, expert_shares, predict_step
from moejax.strategy.spec import Strategy

STALE_TV = 0.1   # share distance past which a remembered drop excess no longer applies
LOADS_KEPT = 8   # loads per member whose drop excess is remembered
EXCESS_SAMPLES = 3   # excesses per (member, load) whose median is believed
DROP_SLACK = (0.01, 0.5)   # drops within 1 point, or half again, of the least are as good

# expert_shares (strategy.cost) is re-exported: the trainer reads the load it decides on here.
__all__ = ["Decision", "StrategySwitcher", "expert_shares"]


@dataclasses.dataclass(frozen=True)
class Decision:
  target: int                      # pool index to switch to
  reason: str                      # "drops" or "time"
  predicted_s: tuple               # per member predicted step seconds
  predicted_drop: tuple            # per member predicted dropped share
  gain_s: float                    # predicted seconds saved over the next `horizon` steps
  switch_cost_s: float


class StrategySwitcher:
  """The switch rule. Where a member drops more than predicted, the excess is remembered with the
  expert shares it was first seen under, and the median of the last `EXCESS_SAMPLES` excesses seen
  near that load (total variation distance of the shares at most `STALE_TV`) is added to that
  member's predictions there: a one-step spike then moves nothing, and an excess seen under one hot
  expert says nothing of the next. A member not yet measured near this load is given the running
  member's excess, since clustered batches drop on every member alike; otherwise a drop spike on the
  running member would make an idle one look better on paper alone.

  Members whose predicted drops are at most `max_drop`, or within `DROP_SLACK` of the least
  (one step's drops vary a lot), are acceptable and compete on time; the current member, if not
  acceptable, is left for the fastest acceptable one whatever the switch costs ("drops").
  Otherwise the trainer moves to the fastest acceptable member only when the time it is
  predicted to save over the next `horizon` steps exceeds the measured cost of going there and
  back ("time"), so two members of near time do not alternate.
  """

  def __init__(self, cfg: StrategyConfig, pool: list[Strategy], workload: Workload,
               profile: HardwareProfile):
    self.cfg, self.pool, self.workload, self.profile = cfg, pool, workload, profile
    # Per member, most recently seen last: (expert shares [L, E] a load was first seen
    # under, the last EXCESS_SAMPLES measured-minus-predicted drops seen near it).
    self.drop_excess: list[list[tuple[np.ndarray, list[float]]]] = [[] for _ in pool]
    self.horizon = cfg.horizon or cfg.every

  def due(self, step: int) -> bool:
    return len(self.pool) > 1 and self.cfg.every > 0 and step > 0 and step % self.cfg.every == 0

  def predict(self, share_LxE: np.ndarray, dispersion: float = 1.0) -> list[StepCost]:
    return [predict_step(s, self.workload, self.profile, share_LxE, dispersion)
            for s in self.pool]

  def _near(self, member: int, share_LxE: np.ndarray) -> int | None:
    """Index of the remembered load of `member` nearest `share_LxE`, if near enough."""
    seen = self.drop_excess[member]
    if not seen:
      return None
    distance = [_distance(load, share_LxE) for load, _ in seen]
    i = int(np.argmin(distance))
    return i if distance[i] <= STALE_TV else None

  def _remember(self, member: int, excess: float, share_LxE: np.ndarray) -> None:
    seen = self.drop_excess[member]
    i = self._near(member, share_LxE)
    load, samples = (share_LxE.copy(), []) if i is None else seen.pop(i)   # keyed by the first
    seen.append((load, (samples + [excess])[-EXCESS_SAMPLES:]))
    del seen[:-LOADS_KEPT]

  def _excess(self, member: int, share_LxE: np.ndarray) -> float | None:
    """The median excess seen on `member` under a load near `share_LxE`, else None."""
    i = self._near(member, share_LxE)
    return None if i is None else float(np.median(self.drop_excess[member][i][1]))

  def decide(self, current: int, share_LxE: np.ndarray,
             switch_cost_s: dict[tuple[int, int], float],
             measured_drop: float | None = None, dispersion: float = 1.0) -> Decision | None:
    """`share_LxE`: expert shares of recent finished steps (rows sum to 1); `switch_cost_s`:
    measured seconds of each (from, to) move; `measured_drop`: the share of choices those
    steps dropped on `current`; `dispersion`: their `load_dispersion`. None = stay."""
    share_LxE = np.asarray(share_LxE, np.float64)
    costs = self.predict(share_LxE, dispersion)
    if measured_drop is not None and np.isfinite(measured_drop):
      self._remember(current, max(measured_drop - costs[current].drop_fraction, 0.0), share_LxE)
    seen = [self._excess(i, share_LxE) for i in range(len(costs))]
    # Members not seen near this load: the running one's miss is taken as the load's.
    load_miss = 0.0 if seen[current] is None else seen[current]
    costs = [dataclasses.replace(c, drop_fraction=min(
                 c.drop_fraction + (load_miss if x is None else x), 1.0))
             for c, x in zip(costs, seen, strict=True)]
    drops = np.array([c.drop_fraction for c in costs])
    ok = drops <= max(self.cfg.max_drop, drops.min() + max(DROP_SLACK[0],
                                                          DROP_SLACK[1] * drops.min()))
    best = min(np.flatnonzero(ok), key=lambda i: (costs[i].total_s, i != current))
    if best == current:
      return None
    cur, new = costs[current], costs[best]
    move_s = switch_cost_s.get((current, best), 0.0)
    round_trip_s = move_s + switch_cost_s.get((best, current), 0.0)
    gain = (cur.total_s - new.total_s) * self.horizon
    if ok[current] and gain <= round_trip_s:
      return None
    return Decision(int(best), "time" if ok[current] else "drops",
                    tuple(c.total_s for c in costs), tuple(drops.tolist()),
                    float(gain), float(move_s))


def _distance(a_LxE: np.ndarray, b_LxE: np.ndarray) -> float:
  """Total variation distance of two loads' expert shares, worst layer."""
  return float(0.5 * np.abs(a_LxE - b_LxE).sum(-1).max())
