"""Host-side code the training loop runs around each step: the hook interface and the two
controllers built on it, layout re-planning (dyn.X) and strategy switching.

The loop calls, for every hook in order (the caller's hooks first, then the controllers):

- `before_step(trainer, step)` on the host before `step` is dispatched. A hook may change
  `trainer.state` and the pool's layouts or active member; it returns True when it spent time
  that is not training (a migration, a switch), so that the loop restarts its tokens/s window.
- `after_metrics(trainer, step, record, counts_LxWxE, member)` once `step`'s metrics have been
  read (one step late unless `planner.fresh`): `record` is the step's metrics record, `counts`
  its routed choices per (layer, source, expert), `member` the pool member that ran it (the
  previous one, for the step in flight at a switch).
- `after_eval(trainer, step, eval_loss)` after an evaluation that ran after `step`.
- `close()` once the run ends (also when it stops early).

Hooks write their events with `trainer.writer.write(...)`.
"""

from __future__ import annotations

import collections
import time

import jax
import numpy as np

from moejax.config import Config
from moejax.layout.migrate import migrate
from moejax.layout.tables import from_placements, from_slot_expert
from moejax.strategy.cost import load_dispersion, load_profile
from moejax.strategy.offline import workload_of
from moejax.strategy.switcher import StrategySwitcher, expert_shares
from moejax.train.plan_ahead import PlanAhead

__all__ = ["Hook", "LayoutReplanning", "StrategySwitching"]


class Hook:
  """The hook interface; every method does nothing unless overridden."""

  def before_step(self, trainer, step: int) -> bool:
    del trainer, step
    return False

  def after_metrics(self, trainer, step: int, record: dict, counts_LxWxE: np.ndarray,
                    member: int) -> None:
    del trainer, step, record, counts_LxWxE, member

  def after_eval(self, trainer, step: int, eval_loss: float) -> None:
    del trainer, step, eval_loss

  def close(self) -> None:
    pass


class LayoutReplanning(Hook):
  """dyn.X: each member's re-planner observes the steps that member ran; before a step is
  dispatched, the active member's layout is re-planned when its planner is due. With
  `lag` > 0 the re-plan runs on a planning thread while the next `lag` steps train and its
  layout is applied before step + lag (`moejax.train.plan_ahead`); `threaded=False` plans on
  the loop's thread instead (the same layouts: the reference the tests compare with).

  Totals for benchmarks: `plans` re-plans made, `planning_s` their planning time (on the
  thread where it ran), `waited_s` the loop's time waiting for a planning thread, `migrations`
  layout changes applied and `migration_s` their time."""

  def __init__(self, lag: int = 0, threaded: bool = True):
    self.ahead = PlanAhead(lag, threaded)
    self.plans = self.migrations = 0
    self.planning_s = self.waited_s = self.migration_s = 0.0

  def before_step(self, trainer, step: int) -> bool:
    pool = trainer.pool
    if pool.planner.due(step):   # lag 0: planned here and taken below
      self.ahead.submit(step, pool.active, pool.planner, pool.placements())
    changed = False
    for plan in self.ahead.take(step):
      changed |= self._apply_plan(trainer, step, plan)
    return changed

  def after_metrics(self, trainer, step, record, counts_LxWxE, member) -> None:
    trainer.pool.planners[member].observe(counts_LxWxE)

  def close(self) -> None:
    self.ahead.close()

  def state_dict(self) -> list[dict]:
    """The re-plans not yet applied (their results): a checkpoint's part."""
    return self.ahead.state_dict()

  def load_state_dict(self, saved: list[dict]) -> None:
    self.ahead.load_state_dict(saved)

  def discard_pending(self) -> None:
    """The active member changed: re-plans made for the previous one's layout are void."""
    self.ahead.discard()

  def replan_now(self, trainer, step: int) -> bool:
    """Re-plans from the finished steps' loads at once, off the period (right after a
    strategy switch); True if the layout changed."""
    pool = trainer.pool
    tick = time.perf_counter()
    new, switches = pool.planner.propose(pool.placements())
    seconds = time.perf_counter() - tick
    self.plans += 1
    self.planning_s += seconds
    return self._apply(trainer, step, new, switches, step, seconds)

  def _apply_plan(self, trainer, step: int, plan) -> bool:
    if plan.member != trainer.pool.active:   # planned for another member's layout
      return False
    tick = time.perf_counter()
    new, switches, seconds = plan.result()   # waits for the planning thread
    self.waited_s += time.perf_counter() - tick
    self.plans += 1
    self.planning_s += seconds
    slots_LxS = trainer.pool.layout.slot_expert_LxS
    if [len(p.slot_expert) for p in new] != [slots_LxS.shape[1]] * slots_LxS.shape[0]:
      # A checkpoint's re-plan, resumed under another expert mode or slot count.
      trainer.writer.write({"step": step, "event": "checkpoint_warning",
                            "message": f"the re-plan planned before step {plan.planned_step} "
                                       "was for another layout shape; dropped"})
      return False
    return self._apply(trainer, step, new, switches, plan.planned_step, seconds)

  def _apply(self, trainer, step: int, new, switches, planned_step: int,
             planning_s: float) -> bool:
    """Adopts placements `new` for the active member (migrating the weights in ep mode) and
    writes one event per layer switched; True if the layout changed."""
    if not switches:
      return False
    pool = trainer.pool
    prog, layout = pool.program, pool.layout
    n, num_experts = prog.mesh.shape["expert"], prog.cfg.moe.num_experts
    moves = prog.expert_mode == "ep"
    if moves:
      jax.block_until_ready(trainer.state)   # time the migration alone, not the step in flight
    tick = time.perf_counter()
    bias = layout.router_bias_LxE
    if moves:                      # slots own weights: move them and their Adam state
      new_layout = jax.device_put(
          from_slot_expert(np.stack([p.slot_expert for p in new]), num_experts).replace(
              router_bias_LxE=bias), prog.layout_sharding)
      trainer.state = migrate(trainer.state, prog.state_layout(layout),
                              prog.state_layout(new_layout))
    else:
      # fsep: the next step restores the new slots; only the tables are uploaded, and the
      # loop does not wait for the step in flight (fsep re-plans after every step by default).
      # They go up from host arrays: a copy from the default device queues behind that step.
      tables = jax.tree.map(np.asarray, from_placements(new, num_experts, n))
      new_layout = jax.device_put(tables.replace(router_bias_LxE=bias), prog.layout_sharding)
    jax.block_until_ready((trainer.state, new_layout) if moves else new_layout)
    seconds = time.perf_counter() - tick
    self.migrations += 1
    self.migration_s += seconds
    pool.set_layout(pool.active, new_layout)
    for sw in switches:
      trainer.writer.write({"step": step, "event": "layout_switch", "layer": sw.layer,
                            "policy": prog.cfg.planner.policy, "planned_step": planned_step,
                            "predicted_gain": sw.predicted_before - sw.predicted_after,
                            "predicted_before": sw.predicted_before,
                            "predicted_after": sw.predicted_after, "planning_s": planning_s,
                            "migration_s": seconds, "experts_moved": sw.experts_moved,
                            "predicted_gain_s": sw.gain_s, "priced_move_s": sw.move_s,
                            "moved_bytes": sw.moved_bytes})
    return True


class StrategySwitching(Hook):
  """The online stage: every `strategy.every` steps, move the state to the pool member
  predicted best for the active member's recent loads (`StrategySwitcher`)."""

  def __init__(self, cfg: Config, pool, layouts: LayoutReplanning):
    self.switcher = StrategySwitcher(cfg.strategy, pool.strategies, workload_of(cfg),
                                     load_profile(cfg.strategy.profile))
    self.layouts = layouts
    # Finished steps of the active member: (counts [L, S, E], dropped share of choices).
    self.recent: collections.deque = collections.deque(maxlen=cfg.planner.window)

  def after_metrics(self, trainer, step, record, counts_LxWxE, member) -> None:
    if member == trainer.pool.active:   # judge the member now running
      self.recent.append((counts_LxWxE,
                          np.mean([r["dropped_fraction"] for r in record["moe"]])))

  def before_step(self, trainer, step: int) -> bool:
    pool = trainer.pool
    if not self.switcher.due(step) or not self.recent:
      return False
    counts = np.stack([c for c, _ in self.recent])
    dropped = float(np.mean([d for _, d in self.recent]))
    decision = self.switcher.decide(pool.active, expert_shares(counts), pool.switch_cost_s,
                                    dropped, load_dispersion(counts))
    if decision is None:
      return False
    jax.block_until_ready(trainer.state)   # time the switch alone, not the step in flight
    tick = time.perf_counter()
    src = pool.active
    trainer.state = pool.move_to(trainer.state, decision.target)
    jax.block_until_ready(trainer.state)
    trainer.writer.write({"step": step, "event": "strategy_switch",
                          "from": pool.programs[src].strategy.spec,
                          "to": pool.program.strategy.spec,
                          "reason": decision.reason, "predicted_s": list(decision.predicted_s),
                          "predicted_drop": list(decision.predicted_drop),
                          "predicted_gain_s": decision.gain_s,
                          "switch_cost_s": decision.switch_cost_s,
                          "seconds": time.perf_counter() - tick})
    self.recent.clear()
    self.layouts.discard_pending()   # planned for the previous member's layout
    if pool.planner.active:   # the member was idle: its re-planner gets this load and re-plans
      pool.planner.clear()   # now, so fsep replicas follow the load from the first step
      for step_counts in counts:
        pool.planner.observe(step_counts)
      self.layouts.replan_now(trainer, step)
    return True
