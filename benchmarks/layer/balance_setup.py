"""The routing, plans and capacity factors of `benchmarks.layer.balance_pays` (host side, numpy).

Expert popularity is log-normal (sigma from the flags) and stable across steps, like a trained
gate; every policy plans on warm-up batches drawn from the same popularity and is then held
to <= 1% dropped choices on a different, timed batch. The plans come from the trainer's own
re-planner (`moejax.train.pool.online_planner`) with the trainer's default options for the
policy's config: its capacity factor and mode, its window, its cost model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import Config
from moejax.layout import capacity, host_layout as placement_lib
from moejax.layout.tables import from_placements, round_robin_placement
from moejax.train.pool import online_planner

POLICIES = ("static", "static_pooled", "smartmoe", "fsep")
CAPACITY = {"static": "slot", "static_pooled": "device", "smartmoe": "device",
            "fsep": "device"}
EXPERT_MODE = {"static": "ep", "static_pooled": "ep", "smartmoe": "ep", "fsep": "fsep"}
PLANNER = {"static": "static", "static_pooled": "static", "smartmoe": "smartmoe",
           "fsep": "fsep"}
MAX_DROPPED = 0.01


def log_popularity(seed: int, experts: int, sigma: float) -> np.ndarray:
  return sigma * np.random.default_rng(seed).standard_normal(experts)


def policy_config(base: Config, policy: str, fsep_slots: int) -> Config:
  """`base` (model, experts, top-k) as the config a run of `policy` has: its expert mode,
  capacity mode, slots and planner policy; every other option the trainer's default."""
  fsep = EXPERT_MODE[policy] == "fsep"
  moe = dataclasses.replace(base.moe, expert_mode=EXPERT_MODE[policy], capacity=CAPACITY[policy],
                            slots_per_device=fsep_slots if fsep else 0)
  planner = dataclasses.replace(Config().planner, policy=PLANNER[policy])
  return dataclasses.replace(base, moe=moe, planner=planner)


def plan(warm_stepsxWxE: np.ndarray, num_devices: int, fsep_slots: int,
         base: Config) -> dict[str, placement_lib.Placement]:
  """Each policy's placement of one layer, from the warm-up steps' counts only, by the
  trainer's re-planner for the policy's config (`policy_config` of `base`)."""
  warm = np.asarray(warm_stepsxWxE, np.float64)
  experts = warm.shape[-1]
  static = placement_lib.static(experts, num_devices)
  start = {"smartmoe": static,
           "fsep": round_robin_placement(experts, num_devices, fsep_slots)}
  out = {"static": static, "static_pooled": static}
  for policy, current in start.items():
    planner = online_planner(policy_config(base, policy, fsep_slots), num_devices)
    for counts_WxE in warm:
      planner.observe(counts_WxE[None])
    out[policy] = planner.propose([current])[0][0]
  return out


def slot_loads(p: placement_lib.Placement, counts_WxE: np.ndarray) -> np.ndarray:
  """[W, S] choices each source sends each slot, as the layer splits them (source w runs on
  expert-axis device w % N)."""
  counts_WxE = np.asarray(counts_WxE, np.int64)
  return placement_lib.split_loads(p, counts_WxE, np.arange(len(counts_WxE)) % p.num_devices)


def needed_factor(policy: str, p: placement_lib.Placement, counts_LxWxE: np.ndarray,
                  tokens: int, top_k: int) -> float:
  """Smallest capacity factor at which no layer drops more than MAX_DROPPED of its choices."""
  return max(capacity.smallest_factor(CAPACITY[policy], slot_loads(p, c), p.slots_per_device,
                                      tokens, top_k, MAX_DROPPED)
             for c in np.asarray(counts_LxWxE))


def predicted_dropped(policy: str, p: placement_lib.Placement, counts_WxE: np.ndarray,
                      tokens: int, top_k: int, factor: float) -> int:
  mode, slots = CAPACITY[policy], p.slots_per_device
  cap = capacity.rows(mode, tokens, top_k, p.num_devices, slots, factor)
  return capacity.dropped(mode, slot_loads(p, counts_WxE), slots, cap)


def device_layout(policy: str, placements: list[placement_lib.Placement], experts: int,
                  router_bias_LxE: np.ndarray | None = None):
  """The Layout a policy's program is fed: one replica per expert in ep, up to N in fsep."""
  replicas = placements[0].num_devices if EXPERT_MODE[policy] == "fsep" else 1
  return from_placements(placements, experts, replicas, router_bias_LxE)
