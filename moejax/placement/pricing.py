"""What a layout switch buys and what it costs, in the run's seconds: the adaptive dyn.X rule.

The gain is the expert compute the busiest device saves per step (the step waits for it:
`CostModel.compute_s` of the max device rows before less after), on the window's finished steps
one by one where they are given: a planner that plans for the steps' spread (fsep's 'spread')
can lose on their mean and still win on the steps, and each step waits for its own busiest
device. The cost is the migration of what actually moves: every (device, expert) copy the
new layout adds that the old one lacked carries the expert's weights and its two Adam moments
(`CostModel.expert_move_s`), and devices receive in parallel, so the busiest receiver sets
the time. fsep restores every slot from the expert-sharded weights each step anyway, so its
switch moves no weights (only the small layout tables, priced at zero). A switch pays when
the gain over `horizon` steps beats the cost.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moejax.layout import host_layout as placement_lib
from moejax.layout.host_layout import Placement
from moejax.placement.layer_cost import CostModel

# Policies whose switch moves no weights: their slots are restored from the expert shards every
# step, whatever the layout.
FREE_MOVE_POLICIES = ("fsep",)


def moves_weights(policy: str) -> bool:
  """Whether a switch of `policy`'s layout moves expert weights."""
  return policy not in FREE_MOVE_POLICIES


class SwitchPrice(NamedTuple):
  gain_s: float        # predicted seconds per step the switch saves (busiest device's compute)
  move_s: float        # seconds the migration costs once
  moved: int           # (device, expert) copies the new layout adds
  moved_bytes: int     # weight and Adam-moment bytes those copies carry (0 where free)

  def pays(self, horizon: int) -> bool:
    """Whether `horizon` steps of the gain beat the migration."""
    return self.gain_s > 0 and self.gain_s * horizon > self.move_s


def planned_load(p: Placement, pred_NxE: np.ndarray) -> np.ndarray:
  """[N]: each device's share of the predicted load under `p` (its slots' shares of their
  experts' totals): what the plan promises, without routing every source's rows."""
  return step_loads(p, np.asarray(pred_NxE, np.float64).sum(0)[None])[0]


def step_loads(p: Placement, totals_stepsxE: np.ndarray) -> np.ndarray:
  """[steps, N]: `planned_load` of each step from its expert totals."""
  se = p.slot_expert
  rows = np.where(se >= 0, p.share * np.asarray(totals_stepsxE, np.float64)[:, np.maximum(se, 0)],
                  0.0)
  return rows.reshape(len(rows), p.num_devices, -1).sum(-1)


def price(cur: Placement, new: Placement, load_before_N: np.ndarray, load_after_N: np.ndarray,
          cost: CostModel, experts: int, moves_weights: bool = True) -> SwitchPrice:
  """The switch `cur` -> `new` of a layer of `experts` priced on the predicted device loads
  before and after: [N], or [steps, N] for the mean over steps of each step's busiest device."""
  added_NxE = placement_lib.presence(new, experts) & ~placement_lib.presence(cur, experts)
  moved = int(added_NxE.sum())
  gain = (cost.compute_s(float(np.max(load_before_N, axis=-1).mean())) -
          cost.compute_s(float(np.max(load_after_N, axis=-1).mean())))
  if not moves_weights:
    return SwitchPrice(gain, 0.0, moved, 0)
  busiest_receiver = int(added_NxE.sum(1).max()) if moved else 0
  return SwitchPrice(gain, cost.expert_move_s(busiest_receiver), moved,
                     cost.expert_move_bytes(moved))


def routes_alike(new: Placement, cur: Placement) -> bool:
  """Whether `new` routes as `cur` does: the same expert in every slot, shares within half a
  router part (the router rounds them to whole parts) and the same local parts."""
  return (np.array_equal(new.slot_expert, cur.slot_expert) and
          np.allclose(new.share, cur.share, atol=0.5 / placement_lib.SHARE_PARTS) and
          np.array_equal(placement_lib.local_parts(new), placement_lib.local_parts(cur)))


class Decision(NamedTuple):
  price: SwitchPrice
  load_before_N: np.ndarray     # the predicted device loads under the current layout
  load_after_N: np.ndarray      # and under the new one


def decide(cur: Placement, new: Placement, pred_NxE: np.ndarray, cost: CostModel,
           moves_weights: bool, horizon: int | None = None,
           totals_stepsxE: np.ndarray | None = None) -> Decision | None:
  """The re-planner's rule for one layer (the trainer's and replay's alike): None where `new`
  routes as `cur` does, or, given `horizon` (adaptive dyn.X past the cold start), where the
  gain over `horizon` steps does not beat the migration; else the switch, priced on the loads
  the plan promises (`planned_load`; per step of `totals_stepsxE`, the window's expert
  totals, where given). A switch that moves no weights (`moves_weights` False) costs nothing
  and is taken: the policy's own score (fsep's: the spread of the steps, the exchange, each
  source's local rows) chose it, and the quota loads priced here see none of that
  (docs/decisions/0093)."""
  if routes_alike(new, cur):
    return None
  before_N, after_N = planned_load(cur, pred_NxE), planned_load(new, pred_NxE)
  if totals_stepsxE is None:
    priced = price(cur, new, before_N, after_N, cost, pred_NxE.shape[1], moves_weights)
  else:
    priced = price(cur, new, step_loads(cur, totals_stepsxE), step_loads(new, totals_stepsxE),
                   cost, pred_NxE.shape[1], moves_weights)
  if horizon is not None and moves_weights and not priced.pays(horizon):
    return None
  return Decision(priced, before_N, after_N)
