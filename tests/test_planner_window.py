"""The re-planner's window: a running sum and per-step totals in place of stacking the window
for every decision, with the same predictions and plans as the stacked mean, bit for bit."""

import json

import numpy as np
import pytest

from moejax.config import PlannerConfig
from moejax.layout import host_layout as placement_lib
from moejax.layout.tables import round_robin_placement
from moejax.placement import fsep, policies
from moejax.placement.fsep.spread import step_totals
from moejax.placement.replanner import OnlinePlanner
from tests.plan_helpers import PLAN_COST

DEVICES, EXPERTS, SLOTS, LAYERS, WINDOW = 8, 16, 4, 2, 3


def _planner(policy="fsep", window=WINDOW):
  return OnlinePlanner(PlannerConfig(policy=policy, every=1, window=window), DEVICES,
                       cost=PLAN_COST, capacity_factor=1.25, capacity="device")


def _recorded(op):
  """Calls of op.propose as (pred_NxE, samples as an array) per layer."""
  seen = []
  def record(pred, cur, **kw):
    steps = kw["samples_stepsxWxE"]
    seen.append((pred, np.stack(list(steps)), getattr(steps, "totals_stepsxE", None)))
    return cur
  op.policy = record
  return seen


def _start():
  return [round_robin_placement(EXPERTS, DEVICES, SLOTS)] * LAYERS


def _steps(n, whole=True, seed=0):
  rng = np.random.default_rng(seed)
  out = rng.lognormal(3.0, 1.0, (n, LAYERS, 2 * DEVICES, EXPERTS))
  return np.rint(out).astype(np.int64) if whole else out


def _check_window(op, seen, kept):
  """The last propose saw the stacked mean of `kept` (folded) and its steps, exactly."""
  folded = [k.reshape(LAYERS, 2, DEVICES, EXPERTS).sum(1).astype(np.float64) for k in kept]
  stacked_SxLxNxE = np.stack(folded)
  pred_LxNxE = policies.predict(stacked_SxLxNxE, op.cfg.window)
  for layer, (pred, samples, totals) in enumerate(seen[-LAYERS:]):
    assert np.array_equal(pred, pred_LxNxE[layer])
    assert np.array_equal(samples, stacked_SxLxNxE[:, layer])
    if totals is not None:
      assert np.array_equal(totals, step_totals(stacked_SxLxNxE[:, layer]))


@pytest.mark.parametrize("whole", [True, False])
def test_window_wraps_around_with_the_stacked_mean(whole):
  op = _planner()
  seen = _recorded(op)
  steps = _steps(2 * WINDOW + 2, whole)
  for t, counts in enumerate(steps):
    op.observe(counts)
    op.propose(_start())
    _check_window(op, seen, steps[max(0, t + 1 - WINDOW):t + 1])


def test_a_step_of_fractions_leaves_the_sum_exact_once_it_is_gone():
  op = _planner()
  seen = _recorded(op)
  steps = list(_steps(2 * WINDOW + 1))
  steps[1] = steps[1] + 0.1                 # not whole: the window is summed afresh
  for t, counts in enumerate(steps):
    op.observe(counts)
    if t % 2:
      op.propose(_start())
      _check_window(op, seen, steps[max(0, t + 1 - WINDOW):t + 1])


def test_clear_forgets_the_sum_and_totals():
  op = _planner()
  seen = _recorded(op)
  first, second = _steps(WINDOW), _steps(2, seed=1)
  for counts in first:
    op.observe(counts)
  op.clear()
  assert not op.due(1)
  for counts in second:
    op.observe(counts)
  op.propose(_start())
  _check_window(op, seen, second)


@pytest.mark.parametrize("policy", ["fsep", "smartmoe"])
def test_state_dict_round_trip_and_old_checkpoints(policy):
  op = _planner(policy)
  steps = _steps(WINDOW + 2)
  for counts in steps:
    op.observe(counts)
  saved = json.loads(json.dumps(op.state_dict()))
  clone = _planner(policy)
  clone.load_state_dict(saved)
  start = (_start() if policy == "fsep" else [placement_lib.static(EXPERTS, DEVICES)] * LAYERS)
  for a, b in zip(op.propose(start)[0], clone.propose(start)[0]):
    assert np.array_equal(a.slot_expert, b.slot_expert) and np.array_equal(a.share, b.share)
  old = {"history": saved["history"]}       # a checkpoint without 'planned' (nor 'rows')
  seen = _recorded(clone)
  clone.load_state_dict(old)
  assert clone.planned
  clone.propose(start)
  _check_window(clone, seen, steps[-WINDOW:])


def test_a_snapshot_keeps_its_window_while_the_planner_observes():
  op = _planner()
  steps = _steps(WINDOW + 3)
  for counts in steps[:WINDOW]:
    op.observe(counts)
  copied = op.snapshot()
  for counts in steps[WINDOW:]:
    op.observe(counts)
  seen = _recorded(copied)
  copied.propose(_start())
  _check_window(copied, seen, steps[:WINDOW])
  seen = _recorded(op)                      # and the planner's own sum went on from there
  for counts in steps[:2]:
    op.observe(counts)
    op.propose(_start())
  _check_window(op, seen, list(steps[WINDOW + 2:]) + list(steps[:2]))


def test_fsep_plans_as_from_the_stacked_window():
  # The trainer's planner against place_replicas on the stacked window, after a wrap-around.
  op = _planner()
  steps = _steps(WINDOW + 2, seed=3)
  for counts in steps:
    op.observe(counts)
  planned, _ = op.propose(_start())
  stacked_SxLxNxE = np.stack([np.asarray(h) for h in op.history])
  pred_LxNxE = stacked_SxLxNxE.mean(0)
  for layer, got in enumerate(planned):
    want = fsep.place_replicas(pred_LxNxE[layer], _start()[layer], slots=SLOTS,
                               src_dev_W=np.arange(DEVICES), cost=PLAN_COST,
                               num_devices=DEVICES, options=op.options,
                               samples_stepsxWxE=stacked_SxLxNxE[:, layer])
    assert np.array_equal(got.slot_expert, want.slot_expert)
    assert np.array_equal(got.share, want.share)
    assert np.array_equal(placement_lib.local_parts(got), placement_lib.local_parts(want))
