"""Compiled programs: one per strategy, built ahead of time, and moves between them.

A `Program` is everything one strategy compiles: its mesh, model, state
shardings and the AOT-compiled train step (`jit(...).lower(...).compile()`).
`Transfer` moves the whole train state from one program to another in one
compiled function: expert slots to canonical (expert-id) order, ep <-> fsep
parameter paths, reshard to the target's shardings, then the target layout's
slot order. `warm_up_pool` compiles, times and runs them all once before
training, so a strategy switch compiles nothing. `CompileCounter` counts XLA
compilations (tests, and the trainer's switch log).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from moejax.config import (
  Config,
  ConfigError,
  MoEConfig,
  default_fsep_slots,
  microbatch_split_error,
  num_moe_layers,
)
from moejax.layout.canonical import convert_tree
from moejax.layout.leaves import gather_slots, is_fsep_expert_leaf
from moejax.layout.migrate import migrate
from moejax.layout.tables import Layout, round_robin_layout, static_layout
from moejax.model import layer_order
from moejax.model.mesh import batch_sharding, build_mesh, param_rules, replicated
from moejax.model.pipeline import Pipelined
from moejax.model.transformer import Transformer, resolve_attention
from moejax.strategy.spec import Strategy
from moejax.train import step as step_lib
from moejax.train.state import TrainState, abstract, init_state, state_shardings

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """`with CompileCounter() as c: ...; c.count` = XLA compilations inside (in any thread),
  executables loaded from JAX's persistent compilation cache included (JAX times both as one
  compile event). Each counter listens only while entered."""

  def __init__(self):
    self.count = 0

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == _COMPILE_EVENT:
      self.count += 1

  def __enter__(self) -> CompileCounter:
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)


def xla_memory(compiled) -> dict[str, int]:
  """Bytes per device of a compiled program, from XLA's own memory analysis."""
  stats = compiled.memory_analysis()
  return {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in XLA_MEMORY_FIELDS}


XLA_MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")


def initial_layout(moe: MoEConfig, num_layers: int, num_devices: int) -> Layout:
  """ep: expert e on device e // (E/N); fsep: C slots per device, round-robin replicas."""
  if moe.expert_mode == "ep":
    return static_layout(num_layers, moe.num_experts, num_devices)
  slots = moe.slots_per_device or default_fsep_slots(moe.num_experts, num_devices)
  return round_robin_layout(num_layers, moe.num_experts, num_devices, slots)


def start_layout(cfg: Config, num_devices: int) -> Layout:
  return initial_layout(cfg.moe, num_moe_layers(cfg.model, cfg.moe), num_devices)


@dataclasses.dataclass
class Program:
  """One strategy, compiled. `layout` is this program's current layout (data)."""
  strategy: Strategy
  cfg: Config
  mesh: Mesh
  model: Transformer | Pipelined   # Pipelined: mesh.stage or V > 1
  shardings: TrainState
  batch_sharding: Any
  layout_sharding: Any
  layout: Layout
  train_step: Any = None          # AOT-compiled (state, batch, layout) -> (state, metrics)
  eval_step: Any = None           # jitted (params, batch, layout) -> ce
  _reorders: dict = dataclasses.field(default_factory=dict)

  @property
  def expert_mode(self) -> str:
    return self.cfg.moe.expert_mode

  def abstract_state(self, tx: optax.GradientTransformation) -> TrainState:
    b, length = self.cfg.data.global_batch_size, self.cfg.data.seq_len
    shapes = jax.eval_shape(lambda: init_state(self.model, tx, self.shardings, self.layout, b,
                                               length, 0))
    return abstract(shapes, self.shardings)

  def abstract_layout(self) -> Layout:
    return abstract(self.layout, jax.tree.map(lambda _: self.layout_sharding, self.layout))

  @property
  def layer_order(self) -> np.ndarray:
    """The canonical layer group at each row of the state's layer axis (identity but for the
    circular schedule: moejax.model.layer_order)."""
    if isinstance(self.model, Pipelined):
      return self.model.layer_order
    return np.arange(num_moe_layers(self.cfg.model, self.cfg.moe))

  def state_layout(self, layout: Layout) -> Layout:
    """`layout` (canonical rows) with its rows in the state's layer order: what a migration of
    the state's expert slots reads."""
    return layer_order.reorder(layout, self.layer_order)

  def canonical_state(self, state: TrainState, back: bool = False) -> TrainState:
    """`state` with its layer groups in canonical order, as checkpoints hold them (`back`:
    from canonical order to this program's); compiled once per direction."""
    order = self.layer_order
    if layer_order.is_identity(order):
      return state
    if back not in self._reorders:
      rows = order if back else layer_order.inverse(order)
      self._reorders[back] = jax.jit(functools.partial(layer_order.reorder_state, order=rows),
                                     out_shardings=self.shardings)
    return self._reorders[back](state)


def build_program(cfg: Config, strategy: Strategy, tx: optax.GradientTransformation,
                  lr_schedule, devices=None, compile_now: bool = True) -> Program:
  """Mesh, model, shardings and (AOT) train step of `strategy` applied to `cfg`."""
  cfg = strategy.apply(cfg)
  mesh = build_mesh(cfg.mesh, devices)
  _check_split(cfg, mesh)
  cfg = dataclasses.replace(cfg, model=resolve_attention(cfg.model, mesh))
  model = Transformer(cfg.model, cfg.moe, mesh, cfg.mesh.fsdp)
  # Microbatches on one stage are the train step's loop (step_lib.accumulated_loss_and_grads:
  # gradients added in place), not a pipeline of one stage, whose differentiated tick loop
  # zero-fills and adds a stack of every layer's gradients per microbatch.
  micro = cfg.train.microbatches
  if cfg.mesh.stage > 1 or cfg.train.virtual_stages > 1:
    model, micro = Pipelined(model, micro, cfg.train.virtual_stages), 1
  layout_sh = replicated(mesh)
  layout = start_layout(cfg, mesh.shape["expert"])
  if mesh.devices.flat[0].client.runtime_type != "compile_only_runtime":   # those hold no data
    # Each process puts its own shards: a device_put onto other processes' devices asks every
    # process for the same value, which a mocked GPU topology's processes cannot answer (the
    # start layout is the same on every process by construction).
    layout = jax.tree.map(lambda a: jax.make_array_from_callback(
        a.shape, layout_sh, lambda index, a=a: a[index]), layout)
  b, length = cfg.data.global_batch_size, cfg.data.seq_len
  shardings = state_shardings(model, tx, mesh, layout, b, length,
                              param_rules(cfg.mesh.fsdp, cfg.mesh.stage > 1))
  prog = Program(strategy, cfg, mesh, model, shardings, batch_sharding(mesh), layout_sh, layout)
  step = jax.jit(
      functools.partial(step_lib.train_step, model=model, tx=tx, moe_cfg=cfg.moe,
                        lr_schedule=lr_schedule, microbatches=micro),
      in_shardings=(shardings, prog.batch_sharding, layout_sh),
      out_shardings=(shardings, layout_sh), donate_argnums=0)   # metrics replicated
  prog.eval_step = jax.jit(
      functools.partial(step_lib.eval_step, model=model, moe_cfg=cfg.moe, microbatches=micro),
      in_shardings=(shardings.params, prog.batch_sharding, layout_sh))
  if compile_now:
    batch = jax.ShapeDtypeStruct((b, length + 1), "int32", sharding=prog.batch_sharding)
    prog.train_step = step.lower(prog.abstract_state(tx), batch, prog.abstract_layout()).compile()
  else:
    prog.train_step = step
  return prog


def _check_split(cfg: Config, mesh: Mesh) -> None:
  """Microbatches and FSDP shards must split evenly over the mesh (one-line errors)."""
  if why := microbatch_split_error(cfg.data.global_batch_size, cfg.train.microbatches,
                                   mesh.shape["data"] * mesh.shape["expert"]):
    raise ConfigError(why + ".")
  heads = cfg.model.num_kv_heads or cfg.model.num_heads   # q heads: a multiple of these
  if heads % mesh.shape["model"]:
    raise ConfigError(f"{heads} key/value heads (model.num_kv_heads, 0: model.num_heads) do "
                      f"not split over mesh.model={mesh.shape['model']}; use a model axis "
                      f"dividing {heads}.")
  for name, size in cfg.model.fsdp_dims().items() if cfg.mesh.fsdp else ():
    if size % mesh.shape["data"]:
      raise ConfigError(f"mesh.fsdp shards parameters' {name}={size} over data="
                        f"{mesh.shape['data']} devices, which does not divide it; set "
                        f"mesh.fsdp = False or a data axis dividing {name}.")


def _move(state: TrainState, src_layout: Layout, dst_layout: Layout, *, src_mode: str,
          dst_mode: str, dst_shardings) -> TrainState:
  if src_mode == "ep" and dst_mode == "fsep":
    # Reshard first (expert-sharded slots -> every expert 1/N per device: one all-to-all),
    # then put the slots in expert-id order locally: gathering along the sharded slot axis
    # first would make XLA all-gather every expert leaf to every device.
    state = jax.lax.with_sharding_constraint(convert_tree(state, "ep", "fsep"), dst_shardings)
    return gather_slots(state, src_layout.expert_slot_LxE, select=is_fsep_expert_leaf)
  if src_mode == "ep":                 # slot order -> expert-id order
    state = gather_slots(state, src_layout.expert_slot_LxE)
  state = convert_tree(state, src_mode, dst_mode)
  if dst_mode == "ep":                 # expert-id order -> the target layout's slot order
    state = gather_slots(state, dst_layout.slot_expert_LxS)
  return state


def _move_ordered(state: TrainState, src_layout: Layout, dst_layout: Layout, *,
                  src_order: np.ndarray, dst_order: np.ndarray, **move) -> TrainState:
  """`_move` between programs whose state layer axes are in `src_order` / `dst_order`
  (moejax.model.layer_order), layouts in canonical rows. Members of one pool share P and V,
  hence one order: the layouts are put in that order and no layer row moves. Different
  orders go through the canonical one."""
  if np.array_equal(src_order, dst_order):
    return _move(state, layer_order.reorder(src_layout, src_order),
                 layer_order.reorder(dst_layout, dst_order), **move)
  state = layer_order.reorder_state(state, layer_order.inverse(src_order))
  return layer_order.reorder_state(_move(state, src_layout, dst_layout, **move), dst_order)


class Transfer:
  """The compiled state move from `src` to `dst` (weights and every optimizer leaf)."""

  def __init__(self, src: Program, dst: Program, tx: optax.GradientTransformation):
    fn = jax.jit(functools.partial(_move_ordered, src_mode=src.expert_mode,
                                   dst_mode=dst.expert_mode, dst_shardings=dst.shardings,
                                   src_order=src.layer_order, dst_order=dst.layer_order),
                 out_shardings=dst.shardings)
    self.src, self.dst = src, dst
    self.compiled = fn.lower(src.abstract_state(tx), src.abstract_layout(),
                             dst.abstract_layout()).compile()

  def __call__(self, state: TrainState) -> TrainState:
    return self.compiled(state, self.src.layout, self.dst.layout)


def _zero_batch(prog: Program) -> jax.Array:
  """A global [B, L+1] batch of token 0 laid out for `prog` (warm-up executions)."""
  shape = (prog.cfg.data.global_batch_size, prog.cfg.data.seq_len + 1)
  return jax.make_array_from_callback(shape, prog.batch_sharding,
                                      lambda index: np.zeros(shape, np.int32)[index])


def warm_up_pool(programs: list[Program], state: TrainState, tx: optax.GradientTransformation,
                 replans: list[bool]) -> tuple[dict, dict]:
  """(transfers, switch_cost_s) of a pool whose member 0 holds `state` (left as it is).

  Compiles the state move of every ordered pair and times each once; runs every other
  member's train step once on a throwaway copy (a first execution costs XLA one-off set-up
  that would otherwise land on the first step after a switch); and compiles the `migrate`
  programs (moved-only and whole) of each ep member that re-plans (`replans[i]`), on a copy
  too (both donate their input). Afterwards a switch or a re-plan compiles and sets up nothing."""
  k = len(programs)
  transfers = {(a, b): Transfer(programs[a], programs[b], tx)
               for a in range(k) for b in range(k) if a != b}
  states = {0: state}
  for a in range(1, k):
    states[a] = transfers[(0, a)](state)
  switch_cost_s = {}
  for (a, b), move in transfers.items():
    jax.block_until_ready(states[a])
    tick = time.perf_counter()
    jax.block_until_ready(move(states[a]))
    switch_cost_s[(a, b)] = time.perf_counter() - tick
  for a, prog in enumerate(programs):
    copy = None
    if a:
      copy, _ = prog.train_step(states.pop(a), _zero_batch(prog), prog.layout)
    if prog.expert_mode == "ep" and replans[a]:   # both programs: moved-only and whole
      copy = migrate(copy if a else transfers[(1, 0)](states[1]),
                     prog.state_layout(prog.layout), prog.state_layout(prog.layout))
      copy = migrate(copy, prog.state_layout(prog.layout), prog.state_layout(prog.layout),
                     whole=True)
    jax.block_until_ready(copy)
  return transfers, switch_cost_s
