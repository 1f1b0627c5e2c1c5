"""The fsep planner's large-mesh arithmetic (decision 0056): from LARGE_MESH devices on it sums
in other orders and breaks exact ties by position, so its plans are not bit for bit those of
the arithmetic below (tests/test_fsep_speedups.py checks each shortcut against a reference of
the same arithmetic); here every by-product it reuses equals what it replaces up to rounding,
and its plans are as level (numpy only)."""

from __future__ import annotations

import numpy as np
import pytest

from moejax.layout import host_layout as placement_lib
from moejax.layout.flow import max_over_mean
from moejax.layout.host_layout import SHARE_PARTS
from moejax.placement import fsep
from moejax.placement.fsep import deal as fsep_deal, score as fsep_score, shares as fsep_shares
from moejax.placement.synthetic import synthetic_trace
from tests.plan_helpers import PLAN_COST


def _snapped_case(n=512, e=64, rounds=8, seed=3):
  pred = synthetic_trace(1, 1, n, e, kind="lognormal", seed=seed)["counts"][0, 0].astype(float)
  load_E = pred.sum(0)
  r_E, coarse_E = fsep.snap_counts(fsep.dhondt_counts(load_E, n * rounds, n), load_E,
                                   n * rounds, n)
  assert coarse_E.any() and not coarse_E.all()           # both kinds of expert present
  return load_E, r_E[None], coarse_E[None]


def test_deal_loads_are_the_even_device_loads():
  load_E, r_candsxE, _ = _snapped_case()
  grid, even_candsxN = fsep_deal.deal(r_candsxE, load_E, 512, 8)
  np.testing.assert_array_equal(np.bincount(grid.ravel(), minlength=len(load_E)), r_candsxE[0])
  per_device = np.sort(grid[0], axis=1)                   # at most one replica per device
  assert not (per_device[:, 1:] == per_device[:, :-1]).any()
  even_share = (1.0 / r_candsxE[0])[grid]
  np.testing.assert_allclose(even_candsxN, fsep_score.device_load(grid, even_share, load_E),
                             rtol=1e-12)


def test_levelled_by_products_match_a_second_pass():
  """The frozen loads from the deal's loads (less the others' even loads) and the busiest
  device levelled reports equal a sum over every replica, up to rounding."""
  load_E, r_candsxE, coarse_candsxE = _snapped_case()
  grid, even_candsxN = fsep_deal.deal(r_candsxE, load_E, 512, 8)
  fast = fsep_shares.levelled(grid, r_candsxE, load_E, 3, coarse_candsxE, even_candsxN=even_candsxN)
  plain = fsep_shares.levelled(grid, r_candsxE, load_E, 3, coarse_candsxE)
  mean = load_E.sum() / 512
  np.testing.assert_allclose(fast.fixed_candsxN, plain.fixed_candsxN, rtol=0, atol=1e-9 * mean)
  np.testing.assert_array_equal(fast.live, plain.live)
  np.testing.assert_allclose(fast.share, plain.share, rtol=1e-9)
  peak = fsep_score.device_load(grid, fast.share, load_E).max(1)
  np.testing.assert_allclose(fast.peak_cands, peak, rtol=1e-12)
  frozen = coarse_candsxE[0][grid[0]]                      # frozen replicas keep 1/r_e exactly
  np.testing.assert_array_equal(fast.share[0][frozen], (1.0 / r_candsxE[0])[grid[0]][frozen])


def test_packed_order_is_expert_then_key_then_tie_rank():
  rng = np.random.default_rng(0)
  for _ in range(30):
    m = int(rng.integers(2, 5000))
    e_sel = rng.integers(0, int(rng.integers(1, 300)), m)
    key = rng.integers(-3, 4, m) * rng.choice([1e-3, 1.0, 7e5])     # many exact ties
    order = fsep_shares.by_expert_then(e_sel, key)
    tie = fsep_shares.tie_rank(e_sel, max(1, (m - 1).bit_length()))
    np.testing.assert_array_equal(order, np.lexsort((tie, key, e_sel)))
    for e in np.unique(e_sel)[:5]:                      # ranks are distinct within an expert
      assert len(np.unique(tie[e_sel == e])) == (e_sel == e).sum()


@pytest.mark.parametrize("n", [64, 255, 256, 4096])
def test_column_sums(n):
  dev_NxE = synthetic_trace(1, 1, n, 32, kind="zipf", seed=n)["counts"][0, 0] * 1.37
  got = fsep_score.column_sums(dev_NxE)
  if n < fsep_deal.LARGE_MESH:
    np.testing.assert_array_equal(got, dev_NxE.sum(0))
  else:        # n rows of one sign: any order is within n ulps of the sum
    np.testing.assert_allclose(got, dev_NxE.sum(0), rtol=4 * n * np.finfo(float).eps)


def _plan(pred, n, e, c):
  se = (np.arange(n * c) % e).astype(np.int32)
  current = placement_lib.Placement(se, 1.0 / np.bincount(se, minlength=e)[se], n)
  return fsep.place_replicas(pred, current, slots=c, src_dev_W=np.arange(n), cost=PLAN_COST,
                             num_devices=n)


@pytest.mark.parametrize("n,e,kind", [(1024, 64, "lognormal"), (4096, 256, "lognormal"),
                                      (512, 64, "zipf")])
def test_large_mesh_plans_are_as_level(n, e, kind, monkeypatch):
  """The same input planned with the large-mesh arithmetic and with the one below it: valid
  plans (whole router parts, one replica per device) whose planned balance (each replica's
  quota, share x expert load) agrees within one part of the hottest expert: rounding to
  parts is where exact ties are broken differently."""
  pred = synthetic_trace(1, 1, n, e, kind=kind, seed=7)["counts"][0, 0].astype(float)
  fast = _plan(pred, n, e, 8)
  for mod in (fsep_deal, fsep_score, fsep_shares):
    monkeypatch.setattr(mod, "LARGE_MESH", n + 1)
  plain = _plan(pred, n, e, 8)
  load_E = pred.sum(0)
  balance = [max_over_mean(np.bincount(np.arange(n * 8) // 8, minlength=n,
                                       weights=p.share * load_E[p.slot_expert]))
             for p in (fast, plain)]
  part = load_E.max() / SHARE_PARTS / (load_E.sum() / n)       # one part, over the mean load
  assert balance[0] <= balance[1] + part + 1e-9, (balance, part)
  parts = fast.share * SHARE_PARTS
  np.testing.assert_array_equal(parts, np.round(parts))
  np.testing.assert_array_equal(np.bincount(fast.slot_expert, weights=parts, minlength=e),
                                np.full(e, SHARE_PARTS))
  dev = np.arange(n * 8) // 8
  assert len(np.unique(dev * e + fast.slot_expert)) == n * 8     # one replica per device
