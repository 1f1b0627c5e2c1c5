"""Public helpers for mesh experiments (notebooks/): one MoE layer on a mesh against the
single-device reference, how arrays are sharded, and wall times of a jitted call."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import MoEConfig
from moejax.layout.tables import Layout, static_layout
from moejax.model.mesh import BATCH_AXES, logical_to_spec, mesh_of_shape
from moejax.model.moe.layer import EXPERT_PARAM_AXES, ROUTER_AXES, moe_apply
from moejax.model.moe.reference import moe_reference


def init_moe_params(key: jax.Array, d_model: int, d_ff: int, num_experts: int) -> dict:
  """One MoE layer's router [D, E] and expert weights [E, D, ffn] / [E, ffn, D], in expert-id
  (= static slot) order."""
  kr, kg, ku, kd = jax.random.split(key, 4)
  normal = lambda k, shape, std: std * jax.random.normal(k, shape, jnp.float32)
  return {"router": normal(kr, (d_model, num_experts), 0.02),
          "w_gate": normal(kg, (num_experts, d_model, d_ff), d_model ** -0.5),
          "w_up": normal(ku, (num_experts, d_model, d_ff), d_model ** -0.5),
          "w_down": normal(kd, (num_experts, d_ff, d_model), d_ff ** -0.5)}


def _objective(y, balance_loss, z_loss):
  return 0.5 * jnp.mean(jnp.square(y)) + 0.01 * balance_loss + 0.001 * z_loss


def _jit(loss: Callable, grads: bool) -> Callable:
  if grads:
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  return jax.jit(lambda *args: (loss(*args), None))   # the same output structure, no backward


@functools.cache   # one compiled program per config (and mesh, below) in a process
def reference_step(cfg: MoEConfig, grads: bool = True) -> Callable:
  """jit((params, x) -> ((loss, y), (d params, d x))) of the reference: every token through
  its top-k experts, no capacity, one device; gradients None unless `grads`."""
  def loss(params, x):
    y, _, bal, z = moe_reference(params, x, cfg.top_k, cfg.normalize_top_k)
    return _objective(y, bal, z), y
  return _jit(loss, grads)


@functools.cache
def sharded_step(cfg: MoEConfig, mesh, grads: bool = True) -> Callable:
  """The same for the sharded layer (`moe_apply` under shard_map) with a layout row as data;
  the auxiliary output is (y, dropped choices)."""
  def loss(params, x, layout_row):
    y, stats = moe_apply(params, x, layout_row, cfg, mesh)
    return _objective(y, stats.balance_loss, stats.z_loss), (y, jnp.sum(stats.dropped_W))
  return _jit(loss, grads)


def place_on_mesh(params: dict, x_BxQxD: jax.Array, layout_row: Layout, mesh):
  """params, tokens and a layout row on `mesh` with the trainer's shardings."""
  specs = {k: logical_to_spec(v) for k, v in EXPERT_PARAM_AXES.items()}
  specs["router"] = logical_to_spec(ROUTER_AXES)
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  x = jax.device_put(x_BxQxD, NamedSharding(mesh, P(BATCH_AXES)))
  return params, x, jax.device_put(layout_row, NamedSharding(mesh, P()))


def layer_vs_reference(shape: tuple[int, int, int], cfg: MoEConfig, params: dict,
                       x_BxQxD: jax.Array, grads: bool = True) -> dict:
  """Runs the layer (and with `grads` its gradients) on the (data, expert, model) mesh `shape`
  with the static layout and on one device; returns the largest differences (grad: None
  without `grads`), the dropped choices, the placed arguments and the jitted step."""
  mesh = mesh_of_shape(shape)
  layout_row = jax.tree.map(lambda a: a[0], static_layout(1, cfg.num_experts,
                                                          mesh.shape["expert"]))
  step = sharded_step(cfg, mesh, grads)
  args = place_on_mesh(params, x_BxQxD, layout_row, mesh)
  (loss, (y, dropped)), g = step(*args)
  (ref_loss, ref_y), ref_g = reference_step(cfg, grads)(params, x_BxQxD)
  grad_diff = None
  if grads:
    grad_diff = max([float(jnp.max(jnp.abs(g[0][k] - ref_g[0][k]))) for k in params] +
                    [float(jnp.max(jnp.abs(g[1] - ref_g[1])))])
  return {"mesh": "x".join(map(str, shape)), "loss": float(loss), "ref_loss": float(ref_loss),
          "max_abs_y_diff": float(jnp.max(jnp.abs(y - ref_y))), "max_abs_grad_diff": grad_diff,
          "dropped": int(dropped), "step": step, "args": args}


def sharding_table(tree) -> list[tuple[str, tuple, str]]:
  """(path, shape, PartitionSpec) of every array leaf of `tree`."""
  rows = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    spec = getattr(leaf.sharding, "spec", None)
    rows.append((jax.tree_util.keystr(path), tuple(leaf.shape), str(spec)))
  return rows


def wall_times(fn: Callable, *args, repeats: int = 3) -> list[float]:
  """Seconds of each of `repeats` calls of `fn(*args)` after one warm-up call (blocking)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    tick = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - tick)
  return times


__all__ = ["init_moe_params", "layer_vs_reference", "place_on_mesh", "reference_step",
           "sharded_step", "sharding_table", "wall_times"]
