"""FSEP: fully sharded experts restored per layout, with replicas, equal the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import MoEConfig
from moejax.layout import host_layout as placement_lib
from moejax.layout.host_layout import SHARE_PARTS
from moejax.layout.tables import from_placements, round_robin_layout
from moejax.model.mesh import logical_to_spec, mesh_of_shape
from moejax.model.moe.fsep_experts import FSEP_PARAM_AXES, restore_slot_weights
from moejax.model.moe.harness import layer_step, reference_step
from moejax.model.moe.layer import moe_apply
from moejax.model.moe.replicas import rank_within_expert
from moejax.train.programs import CompileCounter
from tests.helpers import tokens
from tests.moe_helpers import (
  FSEP_MOE,
  GRAD_LEN,
  LOSS_LEN,
  SMALL_MODEL,
  Y_LEN,
  D,
  E,
  F,
  fsep_loss_and_grad,
  make_params,
  model_lengths,
  random_placement,
  row,
  with_local,
)
from tests.numerics import assert_close, assert_trees_close

LAYOUTS = 20


def _scaled_floor(cum_parts, total):
  """floor(cum_parts * total / SHARE_PARTS) without int32 overflow."""
  q, r = total // SHARE_PARTS, total % SHARE_PARTS
  return cum_parts * q + (cum_parts * r) // SHARE_PARTS


def local_first_slots(expert_TK: jax.Array, counts_NxE: jax.Array, device: jax.Array,
                      expert_slots_ExR: jax.Array, expert_parts_ExR: jax.Array,
                      slots_per_device: int) -> jax.Array:
  """The local-first rule on device, a reference for the host's `placement.route`.

  Slot for each of this device's choices `expert_TK`; `device` is its index in the group.
  Deterministic and identical on every device, from the all-gathered [N, E] counts:
    1. replica r of expert e serves a quota of e's tokens: with cumulative share parts P_r
       (replicas in slot order), floor(P_r * T_e / 1024) - floor(P_{r-1} * T_e / 1024);
    2. a source's choices of e go first to the replica of e on its own device, up to that
       replica's quota (a device holds at most one replica of an expert);
    3. the rest take global positions (sources in order, then token order) and fill the
       remaining quotas in slot order.
  Not used by the layer: it concentrates a source's choices on its local slots, which the
  dense dispatch's fixed per-(source, slot) capacity cannot absorb."""
  num_devices, num_experts = counts_NxE.shape
  valid = expert_slots_ExR >= 0
  total_E = counts_NxE.sum(0)
  hi_ExR = _scaled_floor(jnp.cumsum(expert_parts_ExR, axis=1), total_E[:, None])
  quota_ExR = jnp.diff(hi_ExR, axis=1, prepend=0) * valid
  dev_ExR = jnp.where(valid, expert_slots_ExR // slots_per_device, num_devices)
  e_ExR = jnp.broadcast_to(jnp.arange(num_experts)[:, None], dev_ExR.shape)
  local_quota_NxE = jnp.zeros((num_devices + 1, num_experts), jnp.int32).at[
      dev_ExR, e_ExR].add(quota_ExR)[:num_devices]
  local_take_NxE = jnp.minimum(counts_NxE, local_quota_NxE)
  rem_NxE = counts_NxE - local_take_NxE
  offset_NxE = jnp.cumsum(rem_NxE, axis=0) - rem_NxE
  taken_ExR = jnp.where(valid, local_take_NxE[jnp.minimum(dev_ExR, num_devices - 1), e_ExR], 0)
  bounds_ExR = jnp.cumsum(quota_ExR - taken_ExR, axis=1)
  local_slot_E = jnp.max(jnp.where(dev_ExR == device, expert_slots_ExR, -1), axis=1)

  rank_TK = rank_within_expert(expert_TK, num_experts)
  take_TK = local_take_NxE[device, expert_TK]
  pos_TK = offset_NxE[device, expert_TK] + rank_TK - take_TK
  r_TK = jnp.sum(bounds_ExR[expert_TK] <= pos_TK[:, None], axis=1)
  r_TK = jnp.minimum(r_TK, jnp.sum(valid, axis=1)[expert_TK] - 1)
  remote_TK = jnp.take_along_axis(expert_slots_ExR[expert_TK], r_TK[:, None], axis=1)[:, 0]
  return jnp.where(rank_TK < take_TK, local_slot_E[expert_TK], remote_TK).astype(jnp.int32)


@pytest.mark.parametrize("shape,slots", [((1, 8, 1), 2), ((2, 4, 1), 4)],
                         ids=["1x8x1", "2x4x1"])
@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_fsep_layer_matches_reference_for_random_replicated_layouts(shape, slots):
  mesh = mesh_of_shape(shape)
  n = shape[1]
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=float(n * slots), d_ff=F,
                  expert_mode="fsep")
  rng = np.random.default_rng(0)
  rep = NamedSharding(mesh, P())
  fsep_value_and_grad, reference_value_and_grad = layer_step(cfg, mesh), reference_step(cfg)
  for i in range(LAYOUTS):
    params = make_params(i)
    x = jax.random.normal(jax.random.key(100 + i), (8, 8, D))
    placement = random_placement(rng, n, slots)
    if i % 2:                                   # per-source shares: kept parts first
      placement = with_local(placement, rng)
    layout = jax.device_put(from_placements([placement], E, n), rep)
    (loss, (y, st)), grads = fsep_value_and_grad(params, x, row(layout))
    (ref_loss, (ref_y, ref_counts)), ref_grads = reference_value_and_grad(params, x)
    assert int(np.sum(st.dropped_W)) == 0
    np.testing.assert_array_equal(np.asarray(st.counts_WxE).sum(0), np.asarray(ref_counts))
    assert_close(y, ref_y, Y_LEN, err_msg=f"layout {i}: y")
    assert_close(loss, ref_loss, LOSS_LEN, err_msg=f"layout {i}: loss")
    assert_trees_close(grads, ref_grads, GRAD_LEN)
  assert fsep_value_and_grad._cache_size() == 1, "a new layout recompiled the fsep layer"


@pytest.mark.slow   # 29 s; test_routers' relayout test keeps a compile-count check in the fast set
def test_fsep_relayout_compiles_once():
  mesh = mesh_of_shape((2, 4, 1))
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=16.0, d_ff=F, expert_mode="fsep")
  rep = NamedSharding(mesh, P())
  traces = []

  def f(p, x, layout):
    traces.append(1)
    fsep = {k: p[k][None] for k in ("w_gate", "w_up", "w_down")}
    slot = restore_slot_weights(fsep, layout.slot_expert_LxS, mesh)
    slot_params = {"router": p["router"], **{k: v[0] for k, v in slot.items()}}
    y, _ = moe_apply(slot_params, x, jax.tree.map(lambda a: a[0], layout), cfg, mesh)
    return jnp.sum(y * y)

  step = jax.jit(jax.grad(f))
  params, x = make_params(), jax.random.normal(jax.random.key(1), (8, 8, D))
  rng = np.random.default_rng(3)
  for i in range(5):
    placement = random_placement(rng, 4, 4)
    if i >= 3:                     # layouts with per-source shares (kept parts)
      placement = with_local(placement, rng)
    layout = jax.device_put(from_placements([placement], E, 4), rep)
    with CompileCounter() as compiles:
      jax.block_until_ready(step(params, x, layout))
    assert i == 0 or compiles.count == 0, f"layout {i} compiled {compiles.count} programs"
  assert len(traces) == 1 and step._cache_size() == 1


def _route_on_devices(pick, seed, n=8, slots=2, choices=40):
  """Random replicated placement and per-device expert choices; runs `pick(expert_TK,
  expert_slots, expert_parts)` on each of n devices. Returns (placement, expert_NxTK, slot_NxTK)."""
  mesh = mesh_of_shape((1, n, 1))
  rng = np.random.default_rng(seed)
  placement = random_placement(rng, n, slots)
  layout = from_placements([placement], E, n)
  expert_NxTK = rng.choice(E, size=(n, choices), p=rng.dirichlet(np.full(E, 0.5)))
  fn = jax.jit(jax.shard_map(lambda a, s, p: pick(a[0], s, p)[None], mesh=mesh,
                             in_specs=(P("expert"), P(), P()), out_specs=P("expert")))
  slot_NxTK = np.asarray(fn(jnp.asarray(expert_NxTK, jnp.int32), layout.expert_slots_LxExR[0],
                           layout.expert_parts_LxExR[0]))
  assert np.all(placement.slot_expert[slot_NxTK] == expert_NxTK), "a choice left its expert"
  return placement, expert_NxTK, slot_NxTK


@pytest.mark.parametrize("seed", range(6))
def test_in_graph_replica_routing_equals_host_routing(seed):
  """local_first_slots (device) and placement.route (host) agree slot by slot."""
  n, slots = 8, 2

  def pick(expert_TK, expert_slots, expert_parts):
    counts_E = jnp.zeros((E,), jnp.int32).at[expert_TK].add(1)
    counts_NxE = jax.lax.all_gather(counts_E, "expert")
    return local_first_slots(expert_TK, counts_NxE, jax.lax.axis_index("expert"), expert_slots,
                        expert_parts, slots)

  placement, expert_NxTK, slot_NxTK = _route_on_devices(pick, seed, n, slots)
  counts_WxE = np.stack([np.bincount(row, minlength=E) for row in expert_NxTK])
  slot_load, sent_WxN = placement_lib.route(placement, counts_WxE, np.arange(n))
  got_load = np.bincount(slot_NxTK.reshape(-1), minlength=n * slots)
  np.testing.assert_array_equal(got_load, slot_load)
  got_sent = np.stack([np.bincount(row // slots, minlength=n) for row in slot_NxTK])
  np.testing.assert_array_equal(got_sent, sent_WxN)


def test_round_robin_layout_and_slot_check():
  layout = round_robin_layout(2, 8, 4, 4)
  assert layout.expert_slots_LxExR.shape == (2, 8, 4)
  np.testing.assert_array_equal(np.asarray(layout.expert_parts_LxExR).sum(-1), SHARE_PARTS)
  from moejax.config import ConfigError
  with pytest.raises(ConfigError, match="N\\*C >= E"):
    round_robin_layout(1, 16, 4, 2)


def test_fsep_param_specs_shard_ffn_over_all_group_devices():
  assert logical_to_spec(FSEP_PARAM_AXES["w_gate"]) == P(None, None, None, ("expert", "model"))


@pytest.mark.parametrize("seed", range(4))
def test_in_graph_proportional_split_matches_host(seed):
  """split_slots (device) and placement.split_loads (host) agree per (source, slot)."""
  from moejax.model.moe.replicas import split_slots
  n, slots = 8, 2

  def pick(expert_TK, expert_slots, expert_parts):
    phase = jax.lax.axis_index("expert") * SHARE_PARTS // n
    return split_slots(expert_TK, expert_slots, expert_parts, phase)

  placement, expert_NxTK, slot_NxTK = _route_on_devices(pick, seed, n, slots)
  counts_WxE = np.stack([np.bincount(row, minlength=E) for row in expert_NxTK])
  got = np.stack([np.bincount(row, minlength=n * slots) for row in slot_NxTK])
  np.testing.assert_array_equal(got, placement_lib.split_loads(placement, counts_WxE))


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_whole_fsep_model_on_mesh_matches_one_device():
  """fsep on (2,4,1) (4 slots per device, replicas) == fsep on one device (8 slots)."""
  out = {}
  for shape, slots in (((1, 1, 1), 8), ((2, 4, 1), 4)):
    f, params, layout = fsep_loss_and_grad(shape, slots)
    (loss, aux), grads = f(params, batch_BxQ1=tokens(), layout=layout)
    assert int(np.sum(aux["dropped_LxW"])) == 0
    out[shape] = (float(loss), jax.device_get(grads))
  (l1, g1), (l8, g8) = out[(1, 1, 1)], out[(2, 4, 1)]
  loss_len, grad_len = model_lengths(SMALL_MODEL, FSEP_MOE)
  assert_close(l8, l1, loss_len, err_msg="loss")
  assert_trees_close(g8, g1, grad_len)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_first_layers_restore_is_scheduled_before_the_layer_loop():
  """The compiled forward and backward pass (the train step's program less the optimizer
  update) issues the first MoE layer's restore all_to_alls before the scanned layer loop; the
  loop body restores the next layer (tests/test_fsep_prefetch.py), and the token all_to_alls
  stay inside the loop. Shares the whole-model test's program."""
  f, params, layout = fsep_loss_and_grad((2, 4, 1), 4)
  hlo = f.lower(params, batch_BxQ1=tokens(), layout=layout).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  lines = entry[:entry.index("\n}\n")].splitlines()

  def forward(line):
    return "transpose(" not in line      # the backward pass is the transpose of jvp

  restores = [i for i, line in enumerate(lines) if " all-to-all(" in line and
              "fsep_experts/" in line and forward(line)]
  loops = [i for i, line in enumerate(lines) if " while(" in line and forward(line)]
  layer_a2a_in_entry = [i for i, line in enumerate(lines) if " all-to-all(" in line and
                        "layers/moe" in line]
  assert loops, "expected the layer scan to compile to a while loop"
  assert len(restores) >= 3, "expected layer 0's w_gate/w_up/w_down restores in the entry"
  assert max(restores) < loops[0], "a restore is scheduled after the layer loop starts"
  assert not layer_a2a_in_entry, "token all_to_alls belong inside the layer loop"


def test_host_split_uses_each_sources_device_phase_with_data_rows():
  """With data rows, source s runs on device s % N and uses that device's phase."""
  n, rows = 4, 2
  placement = random_placement(np.random.default_rng(9), n, 4)
  counts = np.random.default_rng(10).integers(0, 50, (rows * n, E))
  src = np.arange(rows * n) % n
  got = placement_lib.split_loads(placement, counts, src)
  for s in range(rows * n):       # each source alone, on its own device
    np.testing.assert_array_equal(got[s], placement_lib.split_loads(
        placement, np.eye(1, rows * n, s, dtype=np.int64) @ counts, np.full(1, src[s]))[0])
