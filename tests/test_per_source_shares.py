"""Per-source token shares (a replica keeps part of its own device's tokens first): the device
router realises exactly what replay computes, and the planner's layouts keep to one replica
per device. tests/test_fsep.py runs layouts with kept parts (`with_local`) through the fsep
layer: they equal the single-device reference and a new one compiles nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.layout import host_layout as placement_lib
from moejax.layout.host_layout import SHARE_PARTS
from moejax.layout.tables import from_placements, to_placements
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.layer import _replica_slots
from moejax.placement import fsep
from moejax.placement.synthetic import synthetic_trace
from tests.moe_helpers import E, random_placement, with_local
from tests.plan_helpers import PLAN_COST


@pytest.mark.parametrize("seed", range(3))
def test_device_router_realises_replays_per_source_counts(seed):
  """The layer's replica choice (kept parts, then the split) and the host's split_loads agree
  per (source, slot), bit for bit, with sources on 8 devices and 2 slots each."""
  n, slots, choices = 8, 2, 300
  rng = np.random.default_rng(seed)
  placement = with_local(random_placement(rng, n, slots), rng)
  layout = from_placements([placement], E, n)
  expert_NxTK = rng.choice(E, size=(n, choices), p=rng.dirichlet(np.full(E, 0.5)))
  mesh = mesh_of_shape((1, n, 1))
  fn = jax.jit(jax.shard_map(
      lambda a, s, p, lp: _replica_slots(a[0], s, p, lp, slots)[None], mesh=mesh,
      in_specs=(P("expert"), P(), P(), P()), out_specs=P("expert")))
  slot_NxTK = np.asarray(fn(jnp.asarray(expert_NxTK, jnp.int32), layout.expert_slots_LxExR[0],
                           layout.expert_parts_LxExR[0], layout.slot_local_parts_LxS[0]))
  assert np.all(placement.slot_expert[slot_NxTK] == expert_NxTK), "a choice left its expert"
  got_WxS = np.stack([np.bincount(row, minlength=n * slots) for row in slot_NxTK])
  counts_WxE = np.stack([np.bincount(row, minlength=E) for row in expert_NxTK])
  want_WxS = placement_lib.split_loads(to_placements(layout, n)[0], counts_WxE)
  np.testing.assert_array_equal(got_WxS, want_WxS)
  np.testing.assert_array_equal(want_WxS, placement_lib.split_loads(placement, counts_WxE))
  own = got_WxS.reshape(n, n, slots)[np.arange(n), np.arange(n)].sum()
  blind = placement_lib.split_loads(placement_lib.Placement(
      placement.slot_expert, placement.share, n, "split"), counts_WxE)
  assert own > blind.reshape(n, n, slots)[np.arange(n), np.arange(n)].sum(), "nothing kept home"


@pytest.mark.parametrize("experts,devices,slots", [(32, 8, 8), (16, 8, 8), (64, 16, 8)])
def test_planner_keeps_one_replica_per_device_and_every_quota(experts, devices, slots):
  """The local-first layouts: no device holds two replicas of an expert; on the counts they
  were planned from, every replica serves the same load as the crossing-blind plan's (within
  rounding: one part of the expert's tokens per replica); fewer rows leave their source."""
  counts = synthetic_trace(3, 1, devices, experts, seed=1)["counts"][:, 0].astype(float)
  src = np.arange(devices)
  for pred in counts:
    plans = {loc: fsep.place_replicas(pred, placement_lib.static(experts, devices),
                                      slots=slots, src_dev_W=src, cost=PLAN_COST,
                                      options=fsep.FsepOptions(locality=loc))
             for loc in (False, True)}
    for p in plans.values():
      p.validate(experts)
      assert placement_lib.one_per_device(p, experts)
    np.testing.assert_array_equal(plans[True].slot_expert, plans[False].slot_expert)
    pred_int = np.rint(pred).astype(np.int64)
    loads = {k: placement_lib.split_loads(p, pred_int, src) for k, p in plans.items()}
    part = pred.sum(0)[plans[True].slot_expert] / SHARE_PARTS
    diff = np.abs(loads[True].sum(0) - loads[False].sum(0))
    assert np.all(diff <= 2 * part + devices), (diff.max(), part.max())
    home = {k: sum(v[s, s * slots:(s + 1) * slots].sum() for s in src) for k, v in loads.items()}
    assert home[True] > home[False]
