"""The strategy pool: one compiled program per strategy, the active one, and the state moves.

A run with `strategy.pool` holds several members (each a `Program`, compiled ahead of time)
and trains on one of them at a time; a run without holds one member, the config's own
strategy. Each member keeps its own layout (data) and its own layout re-planner. The state is
saved in member 0's form, so a checkpoint does not depend on which member was active.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from moejax.config import Config, ConfigError, batch_split_error
from moejax.layout.host_layout import Placement
from moejax.layout.tables import Layout, to_placements
from moejax.placement.replanner import OnlinePlanner
from moejax.strategy.placement_cost import of_config as placement_cost_of
from moejax.strategy.spec import Strategy, check_pool, from_config, parse
from moejax.train.programs import Program, build_program, warm_up_pool
from moejax.train.state import TrainState

__all__ = ["StrategyPool", "online_planner"]


def _check_batch(cfg: Config, shards: int) -> None:
  b = cfg.data.global_batch_size
  if why := batch_split_error(b, shards, "data.global_batch_size"):
    raise ConfigError(why + ".")
  if b % jax.process_count():
    raise ConfigError(f"data.global_batch_size={b} is not divisible by the "
                      f"{jax.process_count()} processes.")


def _dense_capacity(moe) -> float | None:
  """The capacity factor the dense dispatch enforces (None: ragged, dropless)."""
  return None if moe.dispatch == "ragged" else moe.capacity_factor


def online_planner(cfg: Config, num_devices: int) -> OnlinePlanner:
  """The layout re-planner of a program with config `cfg` and `num_devices` on its expert
  axis: the config's policy and options, the dense dispatch's capacity, the run's cost."""
  return OnlinePlanner(cfg.planner, num_devices, placement_cost_of(cfg),
                       capacity_factor=_dense_capacity(cfg.moe), capacity=cfg.moe.capacity,
                       num_groups=cfg.moe.n_group)


class StrategyPool:
  """The members (`programs`), the `active` one, each member's re-planner (`planners`), and
  after `warm_up` the compiled state moves between members and their measured cost."""

  def __init__(self, cfg: Config, tx: optax.GradientTransformation, lr_schedule, devices):
    strategies = [parse(spec) for spec in cfg.strategy.pool]
    if strategies:
      check_pool(strategies, cfg, len(devices))
    else:
      strategies = [from_config(cfg, len(devices))]
    for s in strategies:
      _check_batch(cfg, s.data * s.expert)
    self.strategies: list[Strategy] = strategies
    # Every member is compiled now: a switch or a re-layout later compiles nothing, and the
    # run's memory.txt reports XLA's analysis of the very executable that trains.
    self.programs: list[Program] = [build_program(cfg, s, tx, lr_schedule, devices)
                                    for s in strategies]
    self.planners = [online_planner(p.cfg, p.mesh.shape["expert"]) for p in self.programs]
    self.tx = tx
    self.active = 0
    self.transfers: dict = {}        # (src, dst) -> compiled state move (train.programs)
    self.switch_cost_s: dict = {}    # (src, dst) -> seconds one move took at warm-up
    self._placements: tuple[Layout, list[Placement]] | None = None   # (layout, its placements)

  @property
  def switching(self) -> bool:
    """More than one member: the run may switch strategies."""
    return len(self.strategies) > 1

  @property
  def program(self) -> Program:
    return self.programs[self.active]

  @property
  def planner(self) -> OnlinePlanner:
    return self.planners[self.active]

  @property
  def layout(self) -> Layout:
    return self.program.layout

  def placements(self) -> list[Placement]:
    """The active member's layout as host placements per layer, read from the devices once
    per layout (a re-planner due every step would otherwise copy it back every step)."""
    layout = self.program.layout
    if self._placements is None or self._placements[0] is not layout:
      self._placements = (layout, to_placements(layout, self.program.mesh.shape["expert"]))
    return self._placements[1]

  def set_layout(self, member: int, layout: Layout) -> None:
    """Makes `layout` member `member`'s layout, placed with that member's sharding."""
    prog = self.programs[member]
    prog.layout = jax.device_put(layout, prog.layout_sharding)

  def warm_up(self, state: TrainState) -> None:
    """Compiles, times and runs once every state move and member step (`warm_up_pool`) from
    `state`, in member 0's form (left as it is)."""
    self.transfers, self.switch_cost_s = warm_up_pool(
        self.programs, state, self.tx, [p.active for p in self.planners])

  def move_to(self, state: TrainState, target: int) -> TrainState:
    """`state` (in the active member's form) moved to member `target`, now the active one."""
    state = self.transfers[(self.active, target)](state)
    self.active = target
    return state

  def saved_form(self, state: TrainState) -> tuple[TrainState, Layout, str]:
    """(state, layout, expert mode) as a checkpoint holds them: member 0's form (an exact
    move from the active member), layer groups in canonical order; `active` is left as it
    is."""
    if self.active:
      state = self.transfers[(self.active, 0)](state)
    first = self.programs[0]
    return first.canonical_state(state), first.layout, first.expert_mode

  def state_dict(self) -> dict:
    """The checkpoint's "strategy" block: the pool, the active member, every member's
    layout, so that a resume lands on the same member with the same layouts."""
    return {"pool": [p.strategy.spec for p in self.programs], "active": self.active,
            "layouts": [{k: np.asarray(v).tolist() for k, v in vars(p.layout).items()}
                        for p in self.programs]}

  def load_state_dict(self, saved: dict, state: TrainState) -> TrainState:
    """Restores members 1.. layouts and the active member from a "strategy" block of this
    same pool (else does nothing); `state` is in member 0's form, returned in the active's."""
    if not self.switching or saved.get("pool") != [p.strategy.spec for p in self.programs]:
      return state
    for member, layout in enumerate(saved["layouts"][1:], start=1):
      like = self.programs[member].layout
      # A field a checkpoint predates (e.g. slot_local_parts_LxS) starts at zeros: the plain
      # rule it was trained with.
      self.set_layout(member, Layout(**{
          k: np.asarray(layout[k], dtype=np.asarray(v).dtype) if k in layout
          else np.zeros_like(np.asarray(v)) for k, v in vars(like).items()}))
    if saved["active"]:
      state = self.move_to(state, int(saved["active"]))
    return state
