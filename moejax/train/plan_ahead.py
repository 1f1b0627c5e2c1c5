"""Layout re-plans off the step's critical path (`planner.lag`).

A re-plan that is due before step t is planned from the planner's history as it stands then
(the same finished steps a synchronous re-plan would read) and its layout is applied before
step t + lag, whatever the planning thread's timing: the trainer waits for the plan at that
boundary if it has not finished. So a run's layouts depend on `lag`, never on timing, and a
planning thread and a synchronous reference of the same lag give the same layouts.

Plans due while earlier ones are pending (lag > the re-plan period) are planned against the
layout the earlier ones will have left, which the single planning thread has computed by then
(it runs them in order). A checkpoint holds the pending plans' results (`state_dict` waits for
them), so a resumed run applies the same layouts at the same steps.

Host-side and JAX-free, as the planner is. The thread only reads a copy of the planner's
history; the trainer keeps observing into the planner meanwhile.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any

import numpy as np

from moejax.layout.host_layout import Placement
from moejax.placement.replanner import OnlinePlanner, Switch

__all__ = ["Plan", "PlanAhead", "PlanError"]


class PlanError(RuntimeError):
  """A re-plan failed on the planning thread; raised in the training loop at the step the
  plan was to be applied."""


@dataclasses.dataclass
class Plan:
  """A re-plan planned before `planned_step`, applied before `apply_step` to pool member
  `member`. `future` gives (placements per layer, switches, planning seconds)."""
  planned_step: int
  apply_step: int
  member: int
  future: concurrent.futures.Future

  def result(self) -> tuple[list[Placement], list[Switch], float]:
    try:
      return self.future.result()
    except Exception as e:
      raise PlanError(f"the layout re-plan planned before step {self.planned_step} for step "
                      f"{self.apply_step} failed: {type(e).__name__}: {e}") from e


def _plan(planner: OnlinePlanner, current: list[Placement] | Plan):
  tick = time.perf_counter()
  if isinstance(current, Plan):   # the layout an earlier pending plan leaves
    current = current.result()[0]
  new, switches = planner.propose(current)
  return new, switches, time.perf_counter() - tick


class PlanAhead:
  """Pending re-plans, applied `lag` steps after they were due. `threaded`: plan on one
  worker thread (False: plan at once on the caller's thread, the synchronous reference of
  the same lag, which gives the same layouts)."""

  def __init__(self, lag: int, threaded: bool = True):
    self.lag = lag
    self.threaded = threaded
    self.pending: collections.deque[Plan] = collections.deque()
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None

  def submit(self, step: int, member: int, planner: OnlinePlanner,
             current: list[Placement]) -> Plan:
    """Plans from `planner`'s history now; the plan is applied before `step + lag`. Marks the
    planner as having planned (here, not on the thread: `due` must not depend on timing)."""
    before = next((p for p in reversed(self.pending) if p.member == member), None)
    if self.threaded and self.lag > 0:
      if self._executor is None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="moejax-replan")
      # The thread plans from a snapshot taken before `planned` is set: it keeps whether this
      # is the cold-start plan (always taken, also under planner.adaptive).
      future = self._executor.submit(_plan, planner.snapshot(), before or current)
    else:
      future = concurrent.futures.Future()
      try:
        future.set_result(_plan(planner, before or current))
      except Exception as e:   # raised where a threaded plan's error would be: when applied
        future.set_exception(e)
    planner.planned = True
    plan = Plan(step, step + self.lag, member, future)
    self.pending.append(plan)
    return plan

  def take(self, step: int) -> list[Plan]:
    """The pending plans to apply before `step` (oldest first), removed from the queue."""
    out = []
    while self.pending and self.pending[0].apply_step <= step:
      out.append(self.pending.popleft())
    return out

  def discard(self) -> None:
    """Drops every pending plan (the active pool member changed: they were planned for the
    layout of another member). Waits for the one running."""
    for plan in self.pending:
      plan.future.cancel()
    concurrent.futures.wait([p.future for p in self.pending])
    self.pending.clear()

  def close(self) -> None:
    if self._executor is not None:
      self._executor.shutdown(wait=True)
      self._executor = None

  def state_dict(self) -> list[dict]:
    """The pending plans' results (waiting for them): what a checkpoint holds, so a resumed
    run applies the same layouts at the same steps."""
    out = []
    for plan in self.pending:
      new, switches, seconds = plan.result()
      out.append({"planned_step": plan.planned_step, "apply_step": plan.apply_step,
                  "member": plan.member, "planning_s": seconds,
                  "placements": [placement_to_json(p) for p in new],
                  "switches": [list(s) for s in switches]})
    return out

  def load_state_dict(self, saved: list[dict]) -> None:
    self.discard()
    for d in saved:
      future = concurrent.futures.Future()
      future.set_result(([placement_from_json(p) for p in d["placements"]],
                         [Switch(*s) for s in d["switches"]], float(d["planning_s"])))
      self.pending.append(Plan(int(d["planned_step"]), int(d["apply_step"]), int(d["member"]),
                               future))


def placement_to_json(p: Placement) -> dict[str, Any]:
  """Exact: JSON writes a float64 with the digits that read back to the same value."""
  return {"slot_expert": p.slot_expert.tolist(), "share": np.asarray(p.share).tolist(),
          "num_devices": p.num_devices, "routing": p.routing,
          "local": None if p.local is None else np.asarray(p.local).tolist()}


def placement_from_json(d: dict[str, Any]) -> Placement:
  return Placement(np.asarray(d["slot_expert"], np.int32), np.asarray(d["share"], np.float64),
                   int(d["num_devices"]), d["routing"],
                   None if d["local"] is None else np.asarray(d["local"], np.float64))
