"""Device-pooled capacity (moe.capacity = 'device') equals the reference under its drop rule."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import MoEConfig
from moejax.layout import host_layout as placement_lib
from moejax.layout.host_layout import SHARE_PARTS
from moejax.layout.tables import from_placements
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe import tiled
from moejax.model.moe.harness import in_slots, reference_loss, run_against_reference
from moejax.model.moe.layer import moe_apply
from moejax.model.moe.ops import ops_for
from moejax.model.moe.pooled import device_capacity
from moejax.model.moe.replicas import split_slots
from moejax.model.moe.route import route
from tests.moe_helpers import (
  GRAD_LEN,
  LOSS_LEN,
  Y_LEN,
  D,
  E,
  F,
  make_params,
  pooled_keep,
  random_placement,
  row,
)
from tests.numerics import assert_close, assert_trees_close

BATCH, SEQ = 8, 8


def reference_keep(params, x, layout_row, num_sources, n, slots, cap_dev):
  """keep_TxK over the global tokens: each source's slots as the layer picks them (split_slots
  with the source's phase; ep's one replica gives the expert's slot), then `pooled_keep`."""
  x_TxD = x.reshape(-1, D)
  expert_TxK = np.asarray(route(x_TxD, params["router"], 2, normalize_top_k=True).expert_TxK)
  t_local = expert_TxK.shape[0] // num_sources
  keep = []
  for w in range(num_sources):
    expert_TK = jnp.asarray(expert_TxK[w * t_local:(w + 1) * t_local].reshape(-1))
    phase = (w % n) * SHARE_PARTS // n
    slot_TK = split_slots(expert_TK, layout_row.expert_slots_LxExR,
                         layout_row.expert_parts_LxExR, phase)
    keep.append(pooled_keep(np.asarray(slot_TK), slots, cap_dev))
  return np.concatenate(keep).reshape(expert_TxK.shape)


def _run_against_kept(cfg, mesh, params, x, layout_row, keep):
  """The layer against the reference that drops exactly the choices `keep` marks False."""
  return run_against_reference(cfg, mesh, params, x, layout_row,
                               reference=reference_loss(cfg, keep_TxK=jnp.asarray(keep)))


def _check(run, keep):
  st = run.stats
  assert run.dropped == int(np.sum(~keep)) > 0, "the test should drop"
  assert_close(run.y, run.ref_y, Y_LEN, err_msg="y")
  assert_close(run.loss, run.ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(run.grads, run.ref_grads, GRAD_LEN)
  # What each device computed is what its sources kept for it.
  assert int(np.sum(st.received_WxN)) == int(np.sum(keep))
  np.testing.assert_array_equal(np.asarray(st.received_WxN).sum(-1) + np.asarray(st.overflow_W),
                                _routed_per_device(st))


def _routed_per_device(st):
  slot_counts = np.asarray(st.slot_counts_WxS)
  sources, num_slots = slot_counts.shape
  n = np.asarray(st.received_WxN).shape[1]
  return slot_counts.reshape(sources // n, n, n, num_slots // n).sum((1, 3)).reshape(-1)


@pytest.mark.parametrize("shape,kernels", [((1, 8, 1), "xla"), ((2, 4, 1), "xla"),
                                           ((2, 4, 1), "pallas")],
                         ids=["1x8x1-xla", "2x4x1-xla", "2x4x1-pallas"])
@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_pooled_ep_matches_reference_under_its_drop_rule(shape, kernels):
  mesh = mesh_of_shape(shape)
  n = shape[1]
  slots = E // n
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=0.75, d_ff=F, capacity="device",
                  kernels=kernels)
  slot_expert = np.random.default_rng(1).permutation(E).astype(np.int32)
  placement = placement_lib.Placement(slot_expert, np.ones(E), n)
  layout = jax.device_put(from_placements([placement], E, 1), NamedSharding(mesh, P()))
  params = make_params(3)
  x = jax.random.normal(jax.random.key(7), (BATCH, SEQ, D))
  cap_dev = device_capacity(BATCH * SEQ // (shape[0] * n), 2, n, 0.75)
  keep = reference_keep(params, x, row(layout), shape[0] * n, n, slots, cap_dev)
  _check(_run_against_kept(cfg, mesh, params, x, row(layout), keep), keep)


@pytest.mark.parametrize("shape,slots", [((1, 8, 1), 2), ((2, 4, 1), 4)],
                         ids=["1x8x1", "2x4x1"])
@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_pooled_fsep_with_replicas_matches_reference(shape, slots):
  mesh = mesh_of_shape(shape)
  n = shape[1]
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=0.6, d_ff=F, expert_mode="fsep",
                  capacity="device")
  placement = random_placement(np.random.default_rng(2), n, slots)
  layout = jax.device_put(from_placements([placement], E, n), NamedSharding(mesh, P()))
  params = make_params(4)
  x = jax.random.normal(jax.random.key(8), (BATCH, SEQ, D))
  cap_dev = device_capacity(BATCH * SEQ // (shape[0] * n), 2, n, 0.6)
  keep = reference_keep(params, x, row(layout), shape[0] * n, n, slots, cap_dev)
  _check(_run_against_kept(cfg, mesh, params, x, row(layout), keep), keep)


@pytest.mark.slow   # with the fresh venv's install, over the 8-minute budget
def test_no_drops_pooled_equals_per_slot():
  mesh = mesh_of_shape((2, 4, 1))
  slot_expert = np.arange(E, dtype=np.int32)
  layout = jax.device_put(from_placements([placement_lib.Placement(slot_expert, np.ones(E), 4)],
                                          E, 1), NamedSharding(mesh, P()))
  params = make_params(5)
  x = jax.random.normal(jax.random.key(9), (BATCH, SEQ, D))
  out = {}
  for capacity in ("slot", "device"):
    cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=8.0, d_ff=F, capacity=capacity)
    out[capacity] = run_against_reference(cfg, mesh, params, x, row(layout))
    assert out[capacity].dropped == 0
  got, want = out["device"], out["slot"]
  assert_close(got.y, want.y, Y_LEN)
  assert_close(got.loss, want.loss, LOSS_LEN)
  assert_trees_close(got.grads, want.grads, GRAD_LEN)


@functools.cache
def _layer_fn(cfg, mesh):
  return jax.jit(lambda p, x, layout: moe_apply(p, x, jax.tree.map(lambda a: a[0], layout), cfg,
                                                mesh))


@pytest.mark.slow   # with the fresh venv's install, over the 8-minute budget
def test_pairing_hot_with_cold_drops_fewer_only_under_pooled_capacity():
  """Experts 0 and 1 are hot (router bias). Placing them on one device overflows it under
  pooled capacity; pairing each with a cold expert does not. Per-slot capacity cannot tell
  the two placements apart: each expert keeps its own buffer wherever it sits."""
  n = 4
  mesh = mesh_of_shape((1, n, 1))
  params = make_params(6)
  x = jax.random.normal(jax.random.key(10), (BATCH, SEQ, D))
  bias = np.zeros((1, E), np.float32)
  bias[0, :2] = 0.3
  hot_together = np.array([0, 1, 2, 3, 4, 5, 6, 7], np.int32)
  hot_apart = np.array([0, 2, 1, 3, 4, 5, 6, 7], np.int32)
  drops = {}
  for capacity in ("slot", "device"):
    cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=1.5, d_ff=F, capacity=capacity)
    for name, slot_expert in (("together", hot_together), ("apart", hot_apart)):
      placement = placement_lib.Placement(slot_expert, np.ones(E), n)
      layout = jax.device_put(from_placements([placement], E, 1, bias),
                              NamedSharding(mesh, P()))
      _, st = _layer_fn(cfg, mesh)(in_slots(params, row(layout)), x, layout)
      drops[capacity, name] = int(np.sum(st.dropped_W))
  assert drops["slot", "together"] == drops["slot", "apart"] > 0, drops
  assert drops["device", "apart"] < drops["device", "together"], drops


def test_tiled_swiglu_matches_per_group_swiglu_with_gradients():
  """The fused static-tile SwiGLU (used tiles only, one scan each way) equals each row through
  its group's SwiGLU, rows past the groups giving zeros: value and every gradient."""
  tile, sizes = 8, np.array([5, 0, 13], np.int32)
  groups, width, ffn = len(sizes), 4, 6
  tiles = tiled.num_tiles(int(sizes.sum()), groups, tile)
  rows = tiles * tile
  keys = jax.random.split(jax.random.key(2), 4)
  x = jax.random.normal(keys[0], (rows, width))
  w_gate, w_up = (jax.random.normal(k, (groups, width, ffn)) / width ** 0.5 for k in keys[1:3])
  w_down = jax.random.normal(keys[3], (groups, ffn, width)) / ffn ** 0.5      # O(1) outputs
  group_of_tile = tiled.tile_groups(jnp.asarray(sizes), tiles, tile)
  padded = -(-sizes // tile) * tile
  group_of_row = np.repeat(np.arange(groups), padded)
  used = len(group_of_row)
  group_of_row = np.concatenate([group_of_row, np.zeros(rows - used, int)])
  in_group = (np.arange(rows) < used)[:, None]

  def want_fn(x, wg, wu, wd):
    g = group_of_row
    h = jax.nn.silu(jnp.einsum("mi,mio->mo", x, wg[g])) * jnp.einsum("mi,mio->mo", x, wu[g])
    return jnp.sum(jnp.cos(jnp.where(in_group, jnp.einsum("mi,mio->mo", h, wd[g]), 0.0)))

  # cos: positive terms, so the sum does not cancel below its terms' rounding
  got_fn = lambda x, wg, wu, wd: jnp.sum(jnp.cos(
      tiled.tiled_swiglu(x, wg, wu, wd, group_of_tile, tile)))
  argnums = (0, 1, 2, 3)
  want = jax.value_and_grad(want_fn, argnums)(x, w_gate, w_up, w_down)
  got = jax.jit(jax.value_and_grad(got_fn, argnums))(x, w_gate, w_up, w_down)
  assert_trees_close(got, want, rows * ffn)


def test_tile_is_the_power_of_two_nearest_an_eighth_of_the_share():
  """A share of 1022 rows (fsep at factor 0.998) gets 128-row tiles as 1024 does, not 64: the
  power below an eighth halved the tiles at every share just under 8 x a power of two."""
  assert tiled.tile_rows(4 * 1022, 4) == tiled.tile_rows(4 * 1024, 4) == 128
  assert tiled.tile_rows(4 * 1500, 4) == 256       # 187.5 rows: above 128 sqrt(2), log-nearer 256
  assert tiled.tile_rows(4 * 1400, 4) == 128       # 175 rows: below 181
  assert tiled.tile_rows(2 * 20000, 2) == tiled.MAX_TILE
  assert tiled.tile_rows(3 * 40, 3) == tiled.MIN_TILE
  assert tiled.tile_rows(4 * 9, 4) == 16           # the power of two covering the share


def test_gpu_tile_weighs_each_tiles_cost_against_padding():
  """On XLA:GPU a tile costs a loop launch and its weights' traffic, so tiles are larger: the
  power of two log-nearest sqrt(2 x share x GPU_TILE_COST_ROWS), at most half the share."""
  # The GPU config's pooled buffer (20480 rows, 4 slots): sqrt(5.24e6) = 2290 -> 2048, where
  # XLA:CPU's eighth of the share gives 512; Mixtral-8x7B's fsep at factor 1.125 (36864 rows,
  # 2 slots): 4344 -> 4096.
  assert tiled.tile_rows(20480, 4, "gpu") == 2048
  assert tiled.tile_rows(20480, 4) == tiled.tile_rows(20480, 4, "cpu") == 512
  assert tiled.tile_rows(36864, 2, "cuda") == 4096
  assert tiled.tile_rows(3 * 1000, 3, "gpu") == 256        # 1012 -> 1024, past half of 1000
  assert tiled.tile_rows(3 * 1000, 3, "gpu") * 2 <= 1000
  assert tiled.tile_rows(4 * 9, 4, "gpu") == 16            # never past the share's cover
  assert tiled.tile_rows(8 * 40, 8, "gpu") == tiled.MIN_TILE
  assert ops_for("xla", "gpu").platform == "gpu"           # the layer's tiles see the mesh's
  assert ops_for("xla", "cpu").platform == "cpu"


def test_pooled_capacity_rejects_unknown_names():
  with pytest.raises(Exception, match="moe.capacity='pool'"):
    dataclasses.replace(MoEConfig(), capacity="pool").validate()
