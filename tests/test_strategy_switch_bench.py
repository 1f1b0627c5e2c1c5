"""The drifting-load benchmark's pure parts: phases, hot schedule, fair comparison, turns."""

from __future__ import annotations

import pytest

from benchmarks.strategy_switch import (
  Turns,
  best_fixed,
  hot_schedule,
  parse_phases,
  phase_drops,
  side_by_side,
)
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


def test_side_by_side_hands_a_failure_to_the_caller():
  def bad(turns, me):
    turns.wait(me)
    turns.pass_on(me, finished=True)
    raise ValueError("run 1 failed")

  def good(turns, me):
    turns.wait(me)
    turns.pass_on(me, finished=True)
    return "ok"

  with pytest.raises(ValueError, match="run 1 failed"):
    side_by_side([good, bad])
