"""What the planner studies share (`planner_time` here, `planner_ab` and `smartmoe_ab` in
benchmarks/ab/): the fsep meshes they time, a valid current layout where the static one
cannot exist, and the default config with a policy planning, as the trainer's re-planner
builds it. Host side, numpy."""

from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks.common import default_config
from moejax.config import Config
from moejax.layout import host_layout as placement_lib

# (experts E, devices N) of the fsep latency table, up to 4,096 devices.
FSEP_CONFIGS = ((64, 64), (64, 256), (64, 1024), (256, 4096))


def any_layout(experts: int, devices: int, slots: int) -> placement_lib.Placement:
  """A valid placement for `current` where the static one cannot exist (fsep ignores it)."""
  if experts % devices == 0:
    return placement_lib.static(experts, devices)
  se = (np.arange(devices * slots) % experts).astype(np.int32)
  return placement_lib.Placement(se, 1.0 / np.bincount(se, minlength=experts)[se], devices)


def trainer_config(policy: str, experts: int, slots: int) -> Config:
  """The default config with `policy` planning (SmartMoE in ep under pooled capacity, fsep
  with `slots` per device); every other knob the trainer's default."""
  cfg = default_config()
  fsep = policy == "fsep"
  moe = dataclasses.replace(cfg.moe, num_experts=experts, expert_mode="fsep" if fsep else "ep",
                            slots_per_device=slots if fsep else 0,
                            capacity=cfg.moe.capacity if fsep else "device")
  return dataclasses.replace(cfg, moe=moe, planner=dataclasses.replace(cfg.planner,
                                                                       policy=policy))
