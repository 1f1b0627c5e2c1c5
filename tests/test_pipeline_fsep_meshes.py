"""fsep under stages on two more meshes: P=2 x data=2 x expert=2 and P=4 x expert=2.

test_pipeline_schedules.py shows fsep at P=2 x expert=4; with these every pipeline mesh runs
with ep and with fsep, under the same comparison (tests/moe_helpers.py's check_pipeline: loss,
counts and every gradient against one device running the microbatches one by one). Each case
compiles a pipelined fsep program for minutes on the 2-core VM, hence `slow`.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import TINY_MODEL
from tests.moe_helpers import SMALL_MODEL, SMALL_MOE, check_pipeline

FSEP = dataclasses.replace(SMALL_MOE, expert_mode="fsep")   # MoE layers only (moe_every 1)


@pytest.mark.slow
def test_fsep_p2_d2_e2_matches_one_device():
  """Two MoE layers, one per stage; each stage's expert group is data=2 x expert=2."""
  check_pipeline(SMALL_MODEL, FSEP, (2, 2, 1), stages=2, micro=2)


@pytest.mark.slow
def test_fsep_p4_e2_matches_one_device():
  """Four MoE layers, one per stage, M=4 microbatches over 4 stages of expert=2 each."""
  check_pipeline(TINY_MODEL, FSEP, (1, 2, 1), stages=4, micro=4)
