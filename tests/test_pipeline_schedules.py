"""Pooled capacity, fsep and the circular schedule under pipeline stages equal one device.

As in test_pipeline.py the reference is the unpipelined Transformer on one device, run
microbatch by microbatch (rows i % M == m), losses and gradients averaged. The models have
MoE layers only (moe_every = 1: no dense blocks) to keep the compiles short; each case still
compiles a pipelined program for minutes on this 2-core VM, hence `slow`.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import TINY_MODEL, TINY_MOE
from tests.moe_helpers import check_pipeline

ONLY_MOE = dataclasses.replace(TINY_MOE, moe_every=1)
TWO_LAYERS = dataclasses.replace(TINY_MODEL, num_layers=2)
POOLED = dataclasses.replace(ONLY_MOE, capacity="device")
FSEP = dataclasses.replace(ONLY_MOE, expert_mode="fsep")


@pytest.mark.slow
@pytest.mark.parametrize("moe_cfg", [POOLED, FSEP], ids=["pooled", "fsep"])
def test_p2_e4_matches_one_device(moe_cfg):
  """P=2 x expert=4 with pooled capacity (the default job's) and with fsep experts."""
  check_pipeline(TWO_LAYERS, moe_cfg, (1, 4, 1), stages=2, micro=2)


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [1, 2], ids=["gpipe", "circular"])
def test_gpipe_and_circular_match_one_device(virtual):
  """P=2 x expert=2, four MoE layers: GPipe (2 per stage) and circular (V=2 chunks of one
  per stage: stage 0 holds layers 0 and 2) give one device's loss and gradients."""
  check_pipeline(TINY_MODEL, ONLY_MOE, (1, 2, 1), stages=2, micro=2, virtual=virtual)
