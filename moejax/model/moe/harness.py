"""One MoE layer on a mesh against the single-device reference: build it, compare, time it.

The layer's tests, its benchmarks (benchmarks/moe_layer.py, fsep_vs_ep.py, balance_pays.py)
and the mesh notebook all go through here, so all hold the layer to the same reference on the
same objective:

  init_params            one layer's parameters, experts in expert-id order
  layer_step             jit of (params, x, layout_row) -> ((objective, (y, stats)), grads)
                         for the layer on a mesh in `cfg.expert_mode`
  reference_step         jit of (params, x) -> ((objective, (y, counts)), grads) for
                         `moe_reference` (every token through its top-k experts, one device)
  place_sharded          parameters, tokens and a layout row on a mesh as the trainer keeps
                         them; `in_slots` / `expert_order` between expert and slot order
  run_against_reference  both on the same inputs; check_against_reference raises on a
                         difference
  interleaved_times      wall times of several calls in interleaved rounds

Parameters come in expert-id order. In ep the layer takes them in the layout row's slot order
(`in_slots`; its gradients go back with `expert_order`); in fsep it takes them stored in
expert order and restores the row's slots, as the trainer does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.config import MoEConfig
from moejax.layout.leaves import EXPERT_WEIGHTS
from moejax.layout.tables import Layout, static_layout
from moejax.model.mesh import BATCH_AXES, logical_to_spec
from moejax.model.moe.fsep_experts import FSEP_PARAM_AXES, restore_slot_weights
from moejax.model.moe.layer import EXPERT_PARAM_AXES, ROUTER_AXES, MoEStats, moe_apply
from moejax.model.moe.reference import moe_reference

# The trainer's default weights of the router's losses (MoEConfig.balance_loss_weight and
# z_loss_weight), so that their gradients take part as they do in training.
BALANCE_WEIGHT, Z_WEIGHT = 0.01, 1e-3


def init_params(key: jax.Array, d_model: int, d_ff: int, num_experts: int,
                router_std: float = 0.02) -> dict:
  """One MoE layer's router [D, E] and expert weights [E, D, ffn] / [E, ffn, D] in expert-id
  order, drawn as MoELayer draws them (router_std > 0.02: more decisive routing)."""
  kr, kg, ku, kd = jax.random.split(key, 4)
  normal = lambda k, shape, std: std * jax.random.normal(k, shape, jnp.float32)
  return {"router": normal(kr, (d_model, num_experts), router_std),
          "w_gate": normal(kg, (num_experts, d_model, d_ff), d_model ** -0.5),
          "w_up": normal(ku, (num_experts, d_model, d_ff), d_model ** -0.5),
          "w_down": normal(kd, (num_experts, d_ff, d_model), d_ff ** -0.5)}


def objective(y, balance_loss, z_loss) -> jax.Array:
  """0.5 mean(y^2) plus the router's losses: its gradient reaches every output, router and
  expert weight, at the cost of one elementwise pass (the benchmarks time it)."""
  return (0.5 * jnp.mean(jnp.square(y.astype(jnp.float32))) + BALANCE_WEIGHT * balance_loss +
          Z_WEIGHT * z_loss)


def layer_loss(cfg: MoEConfig, mesh: Mesh) -> Callable:
  """loss(params, x_BxQxD, layout_row) -> (objective, (y, MoEStats)) of the sharded layer in
  `cfg.expert_mode`: ep takes slot-ordered expert weights [S, ...]; fsep stored ones [E, ...]
  (sharded as FSEP_PARAM_AXES without the layer axis), restored by the row's slot table."""
  def loss(params, x_BxQxD, layout_row):
    if cfg.expert_mode == "fsep":
      stored = {k: params[k][None] for k in EXPERT_WEIGHTS}
      restored = restore_slot_weights(stored, layout_row.slot_expert_LxS[None], mesh)
      params = {"router": params["router"], **{k: w[0] for k, w in restored.items()}}
    y, stats = moe_apply(params, x_BxQxD, layout_row, cfg, mesh)
    return objective(y, stats.balance_loss, stats.z_loss), (y, stats)
  return loss


def reference_loss(cfg: MoEConfig, **reference_kwargs) -> Callable:
  """loss(params, x_BxQxD) -> (objective, (y, counts_E)) of `moe_reference` routing as `cfg`
  does; `reference_kwargs` (bias_E, keep_TxK, hosts_ExN, device_limit) as moe_reference's."""
  def loss(params, x_BxQxD):
    y, counts, balance, z = moe_reference(params, x_BxQxD, cfg.top_k, cfg.normalize_top_k,
                                          gate=cfg.gate, route_scale=cfg.route_scale,
                                          **reference_kwargs)
    return objective(y, balance, z), (y, counts)
  return loss


def value_and_grad(loss: Callable, grads: bool = True) -> Callable:
  """jit of ((loss, aux), (d params, d x)) of `loss(params, x, ...)`; without `grads` the
  same structure with None for the gradients (no backward pass)."""
  if grads:
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  return jax.jit(lambda *args: (loss(*args), None))


def layer_step(cfg: MoEConfig, mesh: Mesh, grads: bool = True) -> Callable:
  return value_and_grad(layer_loss(cfg, mesh), grads)


def reference_step(cfg: MoEConfig, grads: bool = True) -> Callable:
  return value_and_grad(reference_loss(cfg), grads)


def in_slots(params: dict, layout_row: Layout) -> dict:
  """ep: expert-id ordered weights -> the row's slot order (slot s holds expert
  slot_expert[s]'s weights)."""
  slot_expert = np.asarray(layout_row.slot_expert_LxS)
  return dict(params, **{k: np.asarray(params[k])[slot_expert] for k in EXPERT_WEIGHTS})


def expert_order(param_grads: dict, layout_row: Layout, expert_mode: str = "ep") -> dict:
  """A layer's parameter gradients in expert-id order: ep's come per slot (one slot per
  expert), fsep's already are."""
  if expert_mode != "ep":
    return param_grads
  expert_slot = np.asarray(layout_row.expert_slot_LxE)
  return dict(param_grads, **{k: np.asarray(param_grads[k])[expert_slot]
                              for k in EXPERT_WEIGHTS})


def place_sharded(params: dict, x_BxQxD, layout_row: Layout, mesh: Mesh,
                  expert_mode: str = "ep") -> tuple[dict, jax.Array, Layout]:
  """(params, tokens, layout row) on `mesh` as the trainer keeps them, `params` given in
  expert-id order: ep's in the row's slot order, sharded by slot over `expert`; fsep's in
  expert order, each expert's F split over all devices. Tokens split over the batch axes."""
  if expert_mode == "ep":
    params = in_slots(params, layout_row)
    specs = {k: logical_to_spec(v) for k, v in EXPERT_PARAM_AXES.items()}
  else:
    specs = {k: logical_to_spec(v[1:]) for k, v in FSEP_PARAM_AXES.items()}
  specs["router"] = logical_to_spec(ROUTER_AXES)
  placed = {k: jax.device_put(params[k], NamedSharding(mesh, spec)) for k, spec in specs.items()}
  return (placed, jax.device_put(x_BxQxD, NamedSharding(mesh, P(BATCH_AXES))),
          jax.device_put(layout_row, NamedSharding(mesh, P())))


class LayerRun(NamedTuple):
  """The layer and the reference on the same inputs, on the host; gradients (d params in
  expert-id order, d x) are None when not asked for. `step(*args)` runs the layer again."""
  loss: float
  ref_loss: float
  y: np.ndarray
  ref_y: np.ndarray
  grads: tuple[dict, np.ndarray] | None
  ref_grads: tuple[dict, np.ndarray] | None
  stats: MoEStats
  ref_counts: np.ndarray        # [E] the reference's choices per expert
  step: Callable
  args: tuple

  @property
  def dropped(self) -> int:
    """Choices the layer dropped for lack of capacity."""
    return int(np.sum(self.stats.dropped_W))

  def max_abs_diff(self) -> dict[str, float | None]:
    """The largest |layer - reference| of the loss, the output and any gradient."""
    grad = None
    if self.grads is not None:
      grad = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                 for a, b in zip(jax.tree.leaves(self.grads), jax.tree.leaves(self.ref_grads)))
    return {"loss": abs(self.loss - self.ref_loss),
            "y": float(np.max(np.abs(self.y - self.ref_y))), "grad": grad}


def run_against_reference(cfg: MoEConfig, mesh: Mesh, params: dict, x_BxQxD,
                          layout_row: Layout | None = None, grads: bool = True,
                          reference: Callable | None = None) -> LayerRun:
  """The layer on `mesh` (`cfg.expert_mode`; the static layout's row unless `layout_row`)
  and the reference on one device (`reference_loss(cfg)` unless `reference`, e.g. one that
  drops what a capacity rule drops), on the same expert-id ordered `params` and tokens."""
  if layout_row is None:
    layout_row = jax.tree.map(lambda a: a[0],
                              static_layout(1, cfg.num_experts, mesh.shape["expert"]))
  step = layer_step(cfg, mesh, grads)
  args = place_sharded(params, x_BxQxD, layout_row, mesh, cfg.expert_mode)
  (loss, (y, stats)), g = jax.device_get(step(*args))
  ref_step = value_and_grad(reference or reference_loss(cfg), grads)
  (ref_loss, (ref_y, ref_counts)), ref_g = jax.device_get(ref_step(params, x_BxQxD))
  if grads:
    g = (expert_order(g[0], layout_row, cfg.expert_mode), g[1])
  return LayerRun(float(loss), float(ref_loss), np.asarray(y), np.asarray(ref_y), g, ref_g,
                  stats, np.asarray(ref_counts), step, args)


def check_against_reference(cfg: MoEConfig, mesh: Mesh, layout_row: Layout, params: dict,
                            x_BxQxD) -> None:
  """One forward + backward of the layer under `layout_row` at a capacity factor at which
  nothing drops equals the reference: loss, input gradient and every parameter gradient
  within rtol 1e-4 (atol 1e-5 of the reference's largest value); RuntimeError otherwise."""
  mode = cfg.expert_mode
  buffers = layout_row.slot_expert_LxS.shape[0] if cfg.capacity == "slot" else (
      mesh.shape["expert"])             # per source
  dropless = float(buffers)             # every buffer holds all of a source's T x K choices
  run = run_against_reference(dataclasses.replace(cfg, capacity_factor=dropless), mesh,
                              params, x_BxQxD, layout_row)
  if run.dropped:
    raise RuntimeError(f"{mode}: the check dropped {run.dropped} choices at factor {dropless}")
  (got_p, got_x), (ref_p, ref_x) = run.grads, run.ref_grads
  pairs = [("loss", run.loss, run.ref_loss), ("x", got_x, ref_x)] + [
      (k, got_p[k], ref_p[k]) for k in sorted(ref_p)]
  for name, a, b in pairs:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.abs(b).max()) or 1.0
    if not np.allclose(a, b, rtol=1e-4, atol=1e-5 * scale):
      raise RuntimeError(f"{mode}: {name} differs from the single-device reference by "
                         f"{float(np.abs(a - b).max()):.3g} (scale {scale:.3g})")


def interleaved_times(calls: dict[str, tuple[Callable, tuple[Any, ...]]],
                      rounds: int) -> dict[str, list[float]]:
  """Seconds of each `fn(*args)` (blocking) per round, over `rounds` rounds after one untimed
  call of each; a round runs every call once, its order rotated by one each round, so that
  load on a shared machine falls on all of them alike."""
  names = list(calls)
  for fn, args in calls.values():
    jax.block_until_ready(fn(*args))
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      fn, args = calls[name]
      tick = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - tick)
  return times
