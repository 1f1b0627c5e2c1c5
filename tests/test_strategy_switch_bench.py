"""The drifting-load benchmark's pure parts: phases, hot schedule, fair comparison, turns."""

from __future__ import annotations

import pytest

from benchmarks.strategy.strategy_switch import best_fixed, hot_schedule, parse_phases, phase_drops
from benchmarks.turns import Turns, side_by_side
from moejax.config import ConfigError


def test_phases_and_hot_schedule():
  phases = parse_phases("uniform:2,hot:1,uniform:1,hot:2")
  assert phases == [("uniform", 2), ("hot", 1), ("uniform", 1), ("hot", 2)]
  assert hot_schedule(phases, 8) == [None, None, 0, None, 3, 3]
  assert phase_drops([0.1, 0.3, 0.5, 0.0, 0.2, 0.4], phases) == pytest.approx(
      [0.2, 0.5, 0.0, 0.3])
  for bad in ("uniform:0", "cold:3", "hot", "uniform:x"):
    with pytest.raises(ConfigError, match="uniform:N or hot:N"):
      parse_phases(bad)


def _run(label, seconds, by_phase):
  return {"label": label, "seconds": seconds, "dropped_by_phase": by_phase}


def test_best_fixed_is_the_fastest_within_the_drop_margin_in_every_phase():
  switching = _run("switching", 10.0, [0.02, 0.05, 0.02])
  ep = _run("ep", 8.0, [0.02, 0.31, 0.02])        # fastest, but collapses in the hot phase
  fsep = _run("fsep", 11.0, [0.01, 0.04, 0.045])
  slow = _run("slow", 12.0, [0.0, 0.0, 0.0])
  assert best_fixed(switching, [ep, fsep, slow], 0.03)["label"] == "fsep"
  assert best_fixed(switching, [ep, fsep, slow], 0.02)["label"] == "slow"   # fsep: 0.045 > 0.04
  assert best_fixed(switching, [ep, slow], 0.03)["label"] == "slow"
  assert best_fixed(switching, [ep], 0.03) is None
  assert best_fixed(switching, [ep], 0.3)["label"] == "ep"


def test_side_by_side_runs_take_one_step_each_in_turn():
  log = []

  def job(steps):
    def run(turns: Turns, me: int):
      for step in range(steps):
        turns.wait(me)
        log.append((me, step))
        if step < steps - 1:
          turns.pass_on(me)
      turns.pass_on(me, finished=True)   # a finished run leaves the rotation
      return me
    return run

  assert side_by_side([job(3), job(1), job(2)]) == [0, 1, 2]
  assert log == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]


def _within(seconds, fn):
  """fn() in a daemon thread; fails instead of hanging the suite when the turns deadlock."""
  import threading
  out = {}

  def go():
    try:
      out["value"] = fn()
    except BaseException as e:   # checked by the caller
      out["error"] = e

  t = threading.Thread(target=go, daemon=True)
  t.start()
  t.join(seconds)
  assert not t.is_alive(), "side_by_side deadlocked"
  return out


def test_side_by_side_hands_a_failure_to_the_caller():
  log = []

  def bad_in_turn(turns, me):
    turns.wait(me)
    raise ValueError("run 1 failed in its turn")

  def bad_before_its_turn(turns, me):   # e.g. a config error while building its trainer
    raise ValueError("run 2 failed before its turn")

  def good(turns, me):
    for step in range(3):
      turns.wait(me)
      log.append((me, step))
      if step < 2:
        turns.pass_on(me)
    turns.pass_on(me, finished=True)
    return "ok"

  out = _within(20, lambda: side_by_side([good, bad_in_turn, bad_before_its_turn, good]))
  assert isinstance(out.get("error"), ValueError) and "run 1" in str(out["error"])
  # The failed runs left the rotation; the others still took strict turns.
  assert log == [(0, 0), (3, 0), (0, 1), (3, 1), (0, 2), (3, 2)]


def test_turns_pass_on_out_of_turn_does_not_move_the_turn():
  turns = Turns([0, 1, 2])
  turns.pass_on(2, finished=True)       # leaves while run 0 holds the turn
  assert turns.order[turns.at] == 0
  turns.pass_on(0)
  assert turns.order[turns.at] == 1
  turns.pass_on(1)
  assert turns.order[turns.at] == 0     # 2 is skipped
  turns.pass_on(2, finished=True)       # twice: still a no-op
  assert turns.order[turns.at] == 0
