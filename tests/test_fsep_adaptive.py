"""Adaptive fsep shares (`moe.fsep_shares = 'adaptive'`): the host rule levels device loads on
the step's own counts, never worse than the planned shares, and keeps own rows home; the
in-graph twin computes the same integers; the layer with it equals the reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moejax.layout import adaptive, placement as placement_lib
from moejax.layout.flow import flow
from moejax.layout.placement import SHARE_PARTS
from tests.moe_helpers import E, random_placement


def _case(seed, n=8, slots=2, skew=0.5):
  rng = np.random.default_rng(seed)
  p = random_placement(rng, n, slots)
  counts_NxE = rng.multinomial(200, rng.dirichlet(np.full(E, skew)), size=n)
  return p, counts_NxE


def _peak(p, parts, counts_E):
  slots, _ = adaptive.replica_tables(p, E)
  load_N = np.zeros(p.num_devices, np.int64)
  q = adaptive.quotas(np, parts, counts_E)
  np.add.at(load_N, np.where(slots >= 0, slots // p.slots_per_device, 0), q)
  return load_N.max()


@pytest.mark.parametrize("seed", range(8))
def test_levelled_parts_are_whole_and_never_worse_than_planned(seed):
  p, counts_NxE = _case(seed)
  slots, planned = adaptive.replica_tables(p, E)
  counts_E = counts_NxE.sum(0).astype(np.int32)
  parts = adaptive.level_parts(np, slots, planned, counts_E, 8, 2)
  np.testing.assert_array_equal(parts.sum(1), SHARE_PARTS)
  assert np.all(parts[slots < 0] == 0) and np.all(parts >= 0)
  assert _peak(p, parts, counts_E) <= _peak(p, planned, counts_E)


def test_levelling_reaches_the_mean_where_every_expert_is_everywhere():
  """With a replica of every expert on every device any load can be levelled: planned shares
  that favour the last device leave it well above the mean on this step; the rounds bring
  the busiest device within a row per expert of the mean."""
  n = 4
  share = np.repeat(np.arange(1, n + 1) ** 2 / np.sum(np.arange(1, n + 1) ** 2), E)
  p = placement_lib.Placement(np.tile(np.arange(E, dtype=np.int32), n), share, n, "split")
  counts_E = np.array([4000, 10, 300, 900, 77, 1200, 5, 2500], np.int32)
  slots, planned = adaptive.replica_tables(p, E)
  parts = adaptive.level_parts(np, slots, planned, counts_E, n, E)
  mean = counts_E.sum() / n
  assert _peak(p, planned, counts_E) > 1.2 * mean
  assert _peak(p, parts, counts_E) <= mean + E


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_split_serves_the_levelled_quotas_and_keeps_own_rows(seed):
  """Every row reaches its expert; each slot serves its levelled quota to within a row per
  source; each device keeps min(own, quota, cap) of its own rows on its own replica."""
  p, counts_NxE = _case(seed)
  slots, planned = adaptive.replica_tables(p, E)
  counts_E = counts_NxE.sum(0).astype(np.int32)
  dev = np.where(slots >= 0, slots // 2, 0)
  own = np.where(slots >= 0, counts_NxE[dev, np.arange(E)[:, None]], 0)
  quota_ExR, _, _ = adaptive.shares(np, slots, planned, counts_E, own, 8, 2, None)
  load_N = np.bincount(dev.ravel(), weights=quota_ExR.ravel(), minlength=8)
  assert load_N.max() <= adaptive.device_peak(np, planned, counts_E, dev, 8)  # never worse
  quota_S = np.zeros(len(p.slot_expert), np.int64)
  quota_S[slots[slots >= 0]] = quota_ExR[slots >= 0]
  local = placement_lib.local_slots(p, E)                     # [N, E] own replica or -1
  for cap in (None, 3):
    loads_NxS = adaptive.split_adaptive(p, counts_NxE, cap)
    per_expert = np.zeros((8, E), np.int64)
    np.add.at(per_expert.T, p.slot_expert, loads_NxS.T)
    np.testing.assert_array_equal(per_expert, counts_NxE)    # nothing lost or misrouted
    # a row per source from its floor, and the room's rounding to parts of SHARE_PARTS
    assert np.abs(loads_NxS.sum(0) - quota_S).max() <= 8 + counts_E.max() // SHARE_PARTS + 1
    d, e = np.nonzero(local >= 0)
    own_slot = local[d, e]
    kept = np.minimum(counts_NxE[d, e], quota_S[own_slot])
    if cap is not None:
      kept = np.minimum(kept, cap)
    assert np.all(loads_NxS[d, own_slot] >= kept)


def test_adaptive_beats_planned_shares_on_a_shifted_step():
  """A layout planned for one load, used on a step whose hot expert moved: re-levelled shares
  bring the busiest device down; the planned ones cannot."""
  rng = np.random.default_rng(5)
  p = random_placement(rng, 8, 2)
  counts = rng.multinomial(400, rng.dirichlet(np.full(E, 0.4)), size=8)
  planned = flow(p, counts, np.arange(8)).device_load_N
  levelled = flow(dataclasses.replace(p, routing="adaptive"), counts, np.arange(8)).device_load_N
  assert planned.sum() == levelled.sum() == counts.sum()
  assert levelled.max() <= planned.max()
  assert levelled.max() / levelled.mean() < planned.max() / planned.mean() - 0.05
