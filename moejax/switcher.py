"""Online stage: pick the pool member to run next from the load of finished steps.

Host-side and JAX-free. Every `strategy.every` steps the trainer hands over the
expert shares of the last finished steps and the share of choices they really
dropped; each member's step time and dropped share are predicted under that load
(moejax.planner.cost), with the spread of a source's count per expert measured
from the same steps (real batches cluster: a sequence repeats its tokens). Where
a member drops more than predicted, the excess is remembered with the expert
shares it was seen under, and added to that member's later predictions while the
load stays near (total variation distance of the shares at most `STALE_TV`): an
excess seen while an fsep member's replicas still served a gone hot expert says
nothing of that member under the next hot expert. A member with no excess seen
near this load is given the running member's: what the model misses there is
taken as the load's doing (clustered batches drop on every member alike) until
that member is measured under it. Without that, a brief drop spike on the running
member made an idle one look better on paper alone, and the trainer went there
and back (measured: both members of an ep/fsep pool dropped ~2.5% at even load
against 0.5% predicted).

Members that drop at most `max_drop` compete on time, the others only on drops.
The trainer switches when the best member differs from the current one and either
the current one breaks the drop limit and the best drops less, or the predicted
time saved over the next `every` steps exceeds the measured cost of going there
and back (a time switch may be undone; without that margin two members of near
time oscillate). A member over the drop limit is left for one that drops less
whatever the switch costs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import StrategyConfig
from moejax.planner.cost import HardwareProfile, StepCost, Workload, predict_step
from moejax.strategy import Strategy

STALE_TV = 0.1   # share distance past which a remembered drop excess no longer applies
LOADS_KEPT = 8   # loads per member whose drop excess is remembered


@dataclasses.dataclass(frozen=True)
class Decision:
  target: int                      # pool index to switch to
  reason: str                      # "drops" or "time"
  predicted_s: tuple               # per member predicted step seconds
  predicted_drop: tuple            # per member predicted dropped share
  gain_s: float                    # predicted seconds saved over the next window
  switch_cost_s: float


class StrategySwitcher:
  def __init__(self, cfg: StrategyConfig, pool: list[Strategy], workload: Workload,
               profile: HardwareProfile):
    self.cfg, self.pool, self.workload, self.profile = cfg, pool, workload, profile
    # Per member, newest last: (measured minus predicted drops, expert shares [L, E] seen under).
    self.drop_excess: list[list[tuple[float, np.ndarray]]] = [[] for _ in pool]

  def due(self, step: int) -> bool:
    return len(self.pool) > 1 and self.cfg.every > 0 and step > 0 and step % self.cfg.every == 0

  def predict(self, share_LxE: np.ndarray, dispersion: float = 1.0) -> list[StepCost]:
    return [predict_step(s, self.workload, self.profile, share_LxE, dispersion)
            for s in self.pool]

  def _score(self, c: StepCost) -> tuple[int, float]:
    return (0, c.total_s) if c.drop_fraction <= self.cfg.max_drop else (1, c.drop_fraction)

  def _remember(self, member: int, excess: float, share_LxE: np.ndarray) -> None:
    seen = [e for e in self.drop_excess[member] if _distance(e[1], share_LxE) > STALE_TV]
    self.drop_excess[member] = (seen + [(excess, share_LxE)])[-LOADS_KEPT:]

  def _excess(self, member: int, share_LxE: np.ndarray) -> float | None:
    """The drop excess last seen on `member` under a load near `share_LxE`, else None."""
    near = [x for x, seen in self.drop_excess[member] if _distance(seen, share_LxE) <= STALE_TV]
    return near[-1] if near else None

  def decide(self, current: int, share_LxE: np.ndarray,
             switch_cost_s: dict[tuple[int, int], float],
             measured_drop: float | None = None, dispersion: float = 1.0) -> Decision | None:
    """`share_LxE`: expert shares of recent finished steps (rows sum to 1); `switch_cost_s`:
    measured seconds of each (from, to) move; `measured_drop`: the share of choices those
    steps dropped on `current`; `dispersion`: their `load_dispersion`. None = stay."""
    share_LxE = np.asarray(share_LxE, np.float64)
    costs = self.predict(share_LxE, dispersion)
    if measured_drop is not None:
      self._remember(current, max(measured_drop - costs[current].drop_fraction, 0.0), share_LxE)
    seen = [self._excess(i, share_LxE) for i in range(len(costs))]
    load_miss = seen[current] or 0.0   # unseen members: the running one's miss is the load's
    costs = [dataclasses.replace(c, drop_fraction=min(
                 c.drop_fraction + (load_miss if x is None else x), 1.0))
             for c, x in zip(costs, seen, strict=True)]
    best = min(range(len(costs)), key=lambda i: (self._score(costs[i]), i != current))
    if best == current:
      return None
    cur, new = costs[current], costs[best]
    move_s = switch_cost_s.get((current, best), 0.0)
    round_trip_s = move_s + switch_cost_s.get((best, current), 0.0)
    gain = (cur.total_s - new.total_s) * self.cfg.every
    breaks = cur.drop_fraction > self.cfg.max_drop and new.drop_fraction < cur.drop_fraction
    if not breaks and gain <= round_trip_s:
      return None
    return Decision(best, "drops" if breaks else "time",
                    tuple(c.total_s for c in costs), tuple(c.drop_fraction for c in costs),
                    float(gain), float(move_s))


def _distance(a_LxE: np.ndarray, b_LxE: np.ndarray) -> float:
  """Total variation distance of two loads' expert shares, worst layer."""
  return float(0.5 * np.abs(a_LxE - b_LxE).sum(-1).max())


def expert_shares(history_TxLxSxE: np.ndarray) -> np.ndarray:
  """Mean expert shares [L, E] of finished steps' count matrices (sources summed)."""
  counts_LxE = np.asarray(history_TxLxSxE, np.float64).sum(axis=(0, 2))
  return counts_LxE / np.maximum(counts_LxE.sum(-1, keepdims=True), 1.0)
