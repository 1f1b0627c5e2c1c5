"""The fsep planner's speed-ups (decisions 0049, 0056) change no plan: each shortcut equals a
plain reference of the same arithmetic bit for bit, in the same process (numpy only).

The references are the straightforward forms the shortcuts replaced: all E x take D'Hondt
values, a lexsort deal that writes the grid once at the end (and sums each device's load),
one min/max per round for the bound, quantise counting and rounding every replica (its order
a lexsort of the quantised key and tie rank from LARGE_MESH devices on). The whole planner
is then run twice, with the package's helpers and with the references, and every array it
returns must be equal. What the large-mesh arithmetic changes against the one below it:
tests/test_fsep_large_mesh.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from moejax.layout import host_layout as placement_lib
from moejax.layout.host_layout import SHARE_PARTS
from moejax.placement import fsep
from moejax.placement.fsep import (
  counts as fsep_counts,
  deal as fsep_deal,
  planner as fsep_planner,
  shares as fsep_shares,
)
from moejax.placement.fsep.score import estimate
from moejax.placement.synthetic import synthetic_trace
from tests.plan_helpers import PLAN_COST


def _top_values_ref(load_E, first_k, cap, take):
  ks = first_k[:, None] + np.arange(min(take, cap))[None, :]
  vals = np.where(ks <= cap, load_E[:, None] / ks, -np.inf).ravel()
  thresh = vals[np.argpartition(-vals, take - 1)[:take]].min()
  chosen = vals > thresh
  chosen[np.flatnonzero(vals == thresh)[:take - int(chosen.sum())]] = True
  return chosen.reshape(len(load_E), -1).sum(1)


def _deal_ref(r_candsxE, load_E, n, rounds):
  r_candsxE = np.atleast_2d(r_candsxE)
  k, num_experts = r_candsxE.shape
  per_candsxE = load_E[None, :] / r_candsxE
  reps = np.empty((k, rounds, n), np.int64)
  for i in range(k):
    order = np.lexsort((np.arange(num_experts), -per_candsxE[i]))
    reps[i] = np.repeat(order, r_candsxE[i][order]).reshape(rounds, n)
  per = per_candsxE.ravel().take(reps + (np.arange(k) * num_experts)[:, None, None])
  if n >= fsep_deal.LARGE_MESH:                  # any bound above every device load will do
    last = 2.0 * float(load_E.sum()) + 1.0
    top = 2.0 * last
  else:
    last, top = 2.0 * float(np.einsum("kjn->k", per).max()) + 1.0, None
  offs = (np.arange(k) * n)[:, None]
  perm, load = np.tile(np.arange(n), (k, 1)), np.zeros((k, n))
  perms = np.empty((rounds, k, n), np.int64)
  for j in range(rounds):
    perms[j] = perm
    load = load + per[:, j]
    if j + 1 == rounds:
      break
    straddle = reps[:, j + 1, :1] == reps[:, j, -1:]
    held = straddle & (reps[:, j] == reps[:, j + 1, :1])
    idx = (fsep_deal.ascending(np.where(held, load + last, load), top=top) + offs).ravel()
    perm = perm.ravel().take(idx).reshape(k, n)
    load = load.ravel().take(idx).reshape(k, n)
  grid = np.empty(k * n * rounds, np.int64)
  grid.put((perms * rounds + np.arange(rounds)[:, None, None] + offs[None] * rounds).ravel(),
           reps.transpose(1, 0, 2).ravel())
  load_dev = np.empty((k, n))
  for i in range(k):
    load_dev[i, perm[i]] = load[i]
  return grid.reshape(k, n, rounds), load_dev


def _deal_bound_ref(r_candsxE, coarse_candsxE, load_E, load_stepsxE, dev_NxE, total_N, n, rounds):
  loads = load_E[None] if load_stepsxE is None else load_stepsxE
  k, num_experts = r_candsxE.shape
  peak, sent = np.empty(k), np.empty(k)
  d = int(np.argmax(total_N))
  for y in range(k):
    r_E = r_candsxE[y]
    order = np.lexsort((np.arange(num_experts), -(load_E / r_E)))
    ends = np.cumsum(r_E[order])
    first_round, last_round = (ends - r_E[order]) // n, (ends - 1) // n
    fixed_stepsxE = np.where(coarse_candsxE[y], loads / r_E, 0.0)[:, order]
    lo, hi = np.empty((len(loads), rounds)), np.empty((len(loads), rounds))
    for j in range(rounds):
      inside = fixed_stepsxE[:, (first_round <= j) & (last_round >= j)]
      lo[:, j], hi[:, j] = inside.min(1), inside.max(1)
    best = (hi + lo.sum(1, keepdims=True) - lo).max(1)
    peak[y] = np.maximum(best, loads.sum(1) / n).mean()
    keep = dev_NxE[d] * np.where(coarse_candsxE[y], 1.0 / r_E, 1.0)
    sent[y] = total_N[d] - np.sort(keep)[-rounds:].sum()
  return peak, sent


def _order_ref(e_sel, key):
  """By expert, then key quantised as `fsep_shares.by_expert_then` does, then tie rank."""
  m = len(e_sel)
  pos_bits = max(1, (m - 1).bit_length())
  key_bits = 62 - pos_bits - max(1, int(e_sel.max()).bit_length())
  width = float(key.max()) - float(key.min())
  scale = float(2 ** key_bits - 1) / width if width > 0 else 0.0
  return np.lexsort((fsep_shares.tie_rank(e_sel, pos_bits),
                     ((key - float(key.min())) * scale).astype(np.int64), e_sel))


def _quantise_ref(grid, share, load_E, groups=8, base_candsxN=None, whole_candsxE=None, live=None,
                  fixed_candsxN=None):
  del live                                # the reference counts and rounds every replica
  k, n, rounds = grid.shape
  num_experts = len(load_E)
  gflat = (grid + (np.arange(k) * num_experts)[:, None, None]).ravel()
  exact = share.ravel() * SHARE_PARTS
  parts = np.floor(exact + 1e-9)
  short = SHARE_PARTS - np.bincount(gflat, weights=parts, minlength=k * num_experts)
  unit = load_E / SHARE_PARTS
  unit_flat = unit.take(grid.ravel())
  if fixed_candsxN is not None and whole_candsxE is not None:   # whole replicas' loads as given
    other = np.flatnonzero(~np.atleast_2d(whole_candsxE).ravel()[gflat])
    dev_load = fixed_candsxN.ravel() + np.bincount(
        other // rounds, weights=(parts * unit_flat)[other], minlength=k * n)
  else:
    dev_load = np.einsum("ir,ir->i", parts.reshape(k * n, rounds),
                         unit_flat.reshape(k * n, rounds))
  mean = np.full(k * n, load_E.sum() / n)
  if base_candsxN is not None:
    dev_load += base_candsxN.ravel()
    mean += np.repeat(base_candsxN.sum(1) / n, n)
  open_ = np.flatnonzero(short.take(gflat) > 0.5)
  if len(open_) == 0:
    return (parts / SHARE_PARTS).reshape(share.shape)
  frac = exact.take(open_) - parts.take(open_)
  rank_E = np.empty(num_experts, np.int64)
  rank_E[np.argsort(-unit, kind="stable")] = np.arange(num_experts)
  group = (rank_E * groups // num_experts).take(gflat.take(open_) % num_experts)
  by_group = np.argsort(group, kind="stable")
  bounds = np.searchsorted(group[by_group], np.arange(groups + 1)).tolist()
  for b in range(groups):
    pick = by_group[bounds[b]:bounds[b + 1]]
    if len(pick) == 0:
      continue
    sel = open_.take(pick)
    e_sel = gflat.take(sel)
    gap = dev_load.take(sel // rounds) - mean.take(sel // rounds)
    if n >= fsep_deal.LARGE_MESH:
      order = _order_ref(e_sel, gap - frac.take(pick) * 1e-6)
    else:
      span = 2.0 * float(np.abs(gap).max()) + 1.0
      order = np.argsort(e_sel + (gap - frac.take(pick) * 1e-6) / span)
    sel, e_sel = sel[order], e_sel[order]
    up = sel[np.arange(len(sel)) - np.searchsorted(e_sel, e_sel) < short.take(e_sel)]
    parts[up] += 1
    dev_load += np.bincount(up // rounds, weights=unit_flat[up], minlength=k * n)
  return (parts / SHARE_PARTS).reshape(share.shape)


def _first_sent_ref(grid, share, peak, bound_s, first, cost, dev_NxE, load_E, total_N):
  del peak, bound_s, first, cost                        # the reference always scores it
  return estimate(grid, share, dev_NxE, load_E, total_N=total_N)[1].max(1)


def test_top_values_equal_all_values():
  rng = np.random.default_rng(0)
  for t in range(400):
    e, cap = int(rng.integers(1, 40)), int(rng.integers(1, 30))
    load = [rng.lognormal(0, 1.5, e) * 100, rng.integers(0, 5, e) * 12.0, np.full(e, 7.0)][t % 3]
    first = rng.integers(2, cap + 3, e)
    avail = int(np.clip(cap + 1 - first, 0, None).sum())
    if avail:
      take = int(rng.integers(1, avail + 1))
      np.testing.assert_array_equal(fsep_counts.top_values(load, first, cap, take),
                                    _top_values_ref(load, first, cap, take))


def _case(n, e, kind, seed, window):
  if kind == "flat":
    steps = np.full((6, n, e), 37.0)
  else:
    steps = synthetic_trace(6 if window else 1, 1, n, e, kind=kind,
                            seed=seed)["counts"][:, 0].astype(float)
  return steps.mean(0), (steps if window else None)


@pytest.mark.parametrize("n,e,c,kind,window,opts", [
    (8, 32, 8, "lognormal", True, {}),
    (8, 32, 4, "zipf", True, {"capacity_factor": 1.25}),
    (16, 32, 8, "collapse", False, {"candidates": fsep.CANDIDATES}),
    (64, 64, 8, "lognormal", False, {"quantise_groups": 8}),
    (64, 64, 8, "flat", True, {}),
    (32, 64, 4, "collapse", True, {"plan_for": "mean", "local_min_rows": 8.0}),
    (8, 8, 16, "lognormal", False, {}),
    (1024, 64, 8, "lognormal", False, {}),
    (4096, 256, 8, "lognormal", False, {}),
])
def test_planner_equals_its_reference_helpers(n, e, c, kind, window, opts, monkeypatch):
  """Every array of the plan (slot experts, shares, per-source kept parts) is the same with
  the shortcuts as with the references, including the skipped rows-sent score."""
  pred, samples = _case(n, e, kind, n + e + c, window)
  se = (np.arange(n * c) % e).astype(np.int32)
  current = placement_lib.Placement(se, 1.0 / np.bincount(se, minlength=e)[se], n)

  def plan():
    return fsep.place_replicas(pred, current, slots=c, src_dev_W=np.arange(n), cost=PLAN_COST,
                               num_devices=n, options=fsep.FsepOptions(**opts),
                               samples_stepsxWxE=samples)

  fast = plan()
  monkeypatch.setattr(fsep_counts, "top_values", _top_values_ref)
  for name, ref in (("deal", _deal_ref), ("deal_bound", _deal_bound_ref),
                    ("quantise", _quantise_ref), ("_first_sent", _first_sent_ref)):
    monkeypatch.setattr(fsep_planner, name, ref)
  monkeypatch.setattr(fsep_shares, "quantise", _quantise_ref)
  slow = plan()
  np.testing.assert_array_equal(fast.slot_expert, slow.slot_expert)
  np.testing.assert_array_equal(fast.share, slow.share)
  assert (fast.local is None) == (slow.local is None)
  if fast.local is not None:
    np.testing.assert_array_equal(fast.local, slow.local)
