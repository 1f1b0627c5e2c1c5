"""The fsep planner's shortcuts change no answer: candidates pruned by a lower bound could not
have been chosen, and the packed-key sort orders devices as a stable argsort (numpy only)."""

from __future__ import annotations

import numpy as np
import pytest

from moejax.layout import host_layout as placement_lib
from moejax.placement import fsep
from moejax.placement.fsep import deal as fsep_deal, planner as fsep_planner
from moejax.placement.synthetic import synthetic_trace
from tests.plan_helpers import PLAN_COST


def _candidates(load_E, n, rounds):
  rs, ms = [], []
  for kind in fsep.CANDIDATES:
    r, m = fsep.snap_counts(fsep.replica_counts(kind, load_E, n * rounds, n), load_E,
                            n * rounds, n)
    rs.append(r)
    ms.append(m)
  return np.stack(rs), np.stack(ms)


@pytest.mark.parametrize("seed", range(4))
def test_deal_bound_never_exceeds_the_score(seed):
  """The bounds on the busiest device and on the rows sent, taken before a candidate is
  placed, are below what placing, levelling and scoring then find, for every candidate (on
  the mean load and on a window's steps)."""
  rng = np.random.default_rng(seed)
  for _ in range(10):
    n, e = int(rng.integers(2, 40)), int(rng.integers(2, 70))
    rounds = min(int(rng.integers(-(-e // n), -(-e // n) + 4)), e)
    dev_NxE = rng.lognormal(0, 1.5, (n, e)) * 40
    dev_NxE[:, rng.random(e) < 0.1] = 0.0                         # some experts get nothing
    load_E = dev_NxE.sum(0)
    r_candsxE, m_candsxE = _candidates(load_E, n, rounds)
    window = None if rng.random() < 0.5 else load_E * rng.lognormal(0, 0.3, (5, e))
    if window is not None:
      window *= load_E.sum() / window.sum(1, keepdims=True)
    total_N = dev_NxE.sum(1)
    peak_lo, sent_lo = fsep_deal.deal_bound(r_candsxE, m_candsxE, load_E, window, dev_NxE,
                                            total_N, n, rounds)
    _, share, peak, sent = fsep_planner.peaks(r_candsxE, m_candsxE, load_E=load_E,
                                              load_stepsxE=window,
                                       dev_NxE=dev_NxE, total_N=total_N, n=n, rounds=rounds,
                                       iters=3)
    assert np.all(peak_lo <= peak * (1 + 1e-9)), (peak_lo, peak)
    assert np.all(sent_lo <= sent + 1e-6), (sent_lo, sent)


@pytest.mark.parametrize("n,e,kind", [(8, 32, "lognormal"), (64, 64, "collapse"),
                                      (1024, 64, "lognormal")])
def test_pruning_changes_no_layout(n, e, kind, monkeypatch):
  pred = synthetic_trace(1, 1, n, e, kind=kind, seed=1)["counts"][0, 0].astype(float)
  src = np.arange(n)
  opts = fsep.FsepOptions(candidates=fsep.CANDIDATES)

  def plan():
    return fsep.place_replicas(pred, placement_lib.static(e, n) if e % n == 0 else
                               placement_lib.Placement(np.zeros(n, np.int32), np.ones(n), n),
                               slots=8, src_dev_W=src, cost=PLAN_COST, num_devices=n,
                               options=opts)

  levelled = []
  peaks = fsep_planner.peaks

  def counted(grid, *a, **kw):
    levelled.append(len(grid))
    return peaks(grid, *a, **kw)

  monkeypatch.setattr(fsep_planner, "peaks", counted)
  pruned = plan()
  kept = sum(levelled)
  monkeypatch.setattr(fsep_planner, "deal_bound",
                      lambda r, *a: (np.zeros(len(r)), np.zeros(len(r))))
  levelled.clear()
  full = plan()
  np.testing.assert_array_equal(pruned.slot_expert, full.slot_expert)
  np.testing.assert_array_equal(pruned.share, full.share)
  if n >= 1024:                      # 'even' snaps every expert: its bound rules it out
    assert kept < sum(levelled), (kept, levelled)


def test_ascending_is_a_stable_argsort():
  rng = np.random.default_rng(0)
  for _ in range(50):
    y, n = int(rng.integers(1, 4)), int(rng.integers(1, 5000))
    key = rng.integers(0, 6, (y, n)) * rng.choice([1e-3, 1.0, 3e4])   # many ties
    np.testing.assert_array_equal(fsep_deal.ascending(key),
                                  np.argsort(key, axis=1, kind="stable"))
  np.testing.assert_array_equal(fsep_deal.ascending(np.zeros((2, 5))),
                                np.tile(np.arange(5), (2, 1)))
