"""FSEP placement (LAER-MoE style): replicas of hot experts, any layout every step.

In FSEP mode every expert's weights are sharded 1/N over all N devices and each step restores
the experts of the layout in use, so a layout may hold several replicas of an expert and may
change every step at no extra cost. The planner (`planner.place_replicas`) is cut by concern:
`counts` (how many replicas), `deal` (which devices), `shares` (how tokens split), `score`
(what a candidate costs), `spread` (planning for the window's spread), `locality` (own
tokens on own replicas first).
"""

from moejax.placement.fsep.counts import (
  CANDIDATES,
  dhondt_counts,
  even_counts,
  replica_counts,
  snap_counts,
)
from moejax.placement.fsep.planner import (
  CAPACITY_MODES,
  CENTERS,
  DEFAULT_CANDIDATES,
  PLAN_FOR,
  TIME_SLACK,
  FsepOptions,
  place_replicas,
)

__all__ = ["CANDIDATES", "CAPACITY_MODES", "CENTERS", "DEFAULT_CANDIDATES", "PLAN_FOR",
           "TIME_SLACK", "FsepOptions", "dhondt_counts", "even_counts", "place_replicas",
           "replica_counts", "snap_counts"]
