"""The cost model planner tests plan with, every field written out: a test's plans then do
not move when a hardware profile's preset or a config default does (the trainer builds its
own from the run, `moejax.strategy.placement_cost`)."""

from __future__ import annotations

from moejax.placement.layer_cost import CostModel

PLAN_COST = CostModel(d_model=128, d_ff=256, flops_per_s=50e12, link_bytes_per_s=50e9,
                      act_bytes=2)
