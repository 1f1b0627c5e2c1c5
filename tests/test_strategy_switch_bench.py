"""The drifting-load benchmark's pure parts: phases, the hot schedule, the fair comparison."""

from __future__ import annotations

import pytest

from benchmarks.strategy_switch import best_fixed, hot_schedule, parse_phases, phase_drops
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
