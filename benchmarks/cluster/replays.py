"""Each placement policy replayed on a routing through the trainer's own re-planner (its
options, window, period, adaptive rule, capacity and cost model: `moejax.train.pool.
online_planner` of the policy's config) and the trainer's loop around it, which reads a step's
counts one step late (`moejax.placement.trace_replay.replay_trainer`): the capacity factor the
policy needs for <= 1% drops, how far the busiest device's rows sit above the mean, the
planner's decision time and the ep migrations it makes.

One data row of the mesh is replayed (its expert-axis devices, one source each): every data
row routes alike under the study's routings, and the drop target is a fraction of all
choices, so more rows change the factor only by sampling. The dense policies run under pooled
capacity (`moe.capacity = 'device'`, the default job's), where a permutation can change drops;
dropless ragged runs the static layout into a receive buffer per device.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moejax.config import Config
from moejax.layout import host_layout as placement_lib
from moejax.layout.tables import round_robin_placement
from moejax.placement.buffers import MAX_DROPPED
from moejax.placement.trace_replay import replay_trainer
from moejax.train.pool import online_planner

# policy -> (expert mode, planner policy, fsep shares); "ragged" is the static layout under
# the ragged dispatch.
POLICIES = {
    "static": ("ep", "static", "planned"),
    "smartmoe": ("ep", "smartmoe", "planned"),
    "fsep_planned": ("fsep", "fsep", "planned"),
    "fsep_adaptive": ("fsep", "fsep", "adaptive"),
    "ragged": ("ep", "static", "planned"),
}
CAPACITY = "device"


def profile_name(expert_axis: int, per_host: int = 8) -> str:
  """The H100 profile whose all-to-all the expert axis runs on: NVLink inside a host, the
  network across."""
  return "h100_node" if expert_axis <= per_host else "h100_cluster"


def policy_config(cfg: Config, policy: str, expert_axis: int) -> Config:
  """`cfg` as a run of `policy` configures it: expert mode, pooled capacity (dense), the
  planner's policy, the H100 profile of its expert axis; every other option the trainer's
  default (slots per device: the config's rule)."""
  mode, planner, shares = POLICIES[policy]
  moe = dataclasses.replace(
      cfg.moe, expert_mode=mode, capacity=CAPACITY, fsep_shares=shares,
      dispatch="ragged" if policy == "ragged" else "dense")
  return dataclasses.replace(
      cfg, moe=moe, planner=dataclasses.replace(cfg.planner, policy=planner),
      strategy=dataclasses.replace(cfg.strategy, profile=profile_name(expert_axis)))


def fsep_slots(cfg: Config, devices: int) -> int:
  """The slots per device an fsep program gets (moe.slots_per_device; 0: min(E, 2 ceil(E/N)))."""
  e = cfg.moe.num_experts
  return cfg.moe.slots_per_device or min(e, 2 * -(-e // devices))


def ragged_factor(loads_SxLxN: np.ndarray, choices: int) -> float:
  """Smallest receive-buffer factor (rows = factor x T*K per device) that drops <= 1% of the
  choices when each device receives `loads` rows (bisection; drops fall as it grows)."""
  loads = np.asarray(loads_SxLxN, np.float64)
  allowed = MAX_DROPPED * loads.sum()
  lo, hi = 0.0, float(loads.max() / choices) + 1e-9
  for _ in range(50):
    mid = 0.5 * (lo + hi)
    rows = math.ceil(mid * choices)
    lo, hi = (lo, mid) if np.maximum(loads - rows, 0).sum() <= allowed else (mid, hi)
  return hi


def static_loads(counts_SxLxWxE: np.ndarray, devices: int) -> np.ndarray:
  """[S, L, N]: the rows each device receives under the static layout (all sources)."""
  p = placement_lib.static(counts_SxLxWxE.shape[-1], devices)
  totals = np.asarray(counts_SxLxWxE).sum(2)                    # [S, L, E]
  return totals[..., np.maximum(p.slot_expert, 0)].reshape(*totals.shape[:2], devices, -1).sum(-1)


def decision_time(cfg: Config, policy: str, counts_SxLxWxE: np.ndarray, devices: int,
                  repeats: int = 3) -> dict:
  """One re-plan as the trainer makes it (`OnlinePlanner.propose` of every layer of the
  routing, after `planner.window` observed steps, from the start layout), timed `repeats`
  times: the median per layer in CPU seconds of this process (`time.process_time`: on a
  shared host the wall time counts the other processes' turns) and in wall seconds."""
  import time

  pcfg = policy_config(cfg, policy, devices)
  planner = online_planner(pcfg, devices)
  if not planner.active:
    return {"cpu_ms_per_layer": None, "wall_ms_per_layer": None}
  counts = np.asarray(counts_SxLxWxE)
  for step in counts[:pcfg.planner.window]:
    planner.observe(step)
  experts, layers = counts.shape[-1], counts.shape[1]
  start = (placement_lib.static(experts, devices) if POLICIES[policy][0] == "ep" else
           round_robin_placement(experts, devices, fsep_slots(pcfg, devices)))
  cpu, wall = [], []
  for _ in range(repeats):
    c0, w0 = time.process_time(), time.perf_counter()
    planner.propose([start] * layers)
    cpu.append((time.process_time() - c0) / layers)
    wall.append((time.perf_counter() - w0) / layers)
  return {"cpu_ms_per_layer": 1e3 * float(np.median(cpu)),
          "wall_ms_per_layer": 1e3 * float(np.median(wall)), "repeats": repeats}


def busiest(series_SxL: np.ndarray, factor: float) -> float:
  """The busiest device's rows over the mean, averaged over steps x layers, when its buffer
  holds `factor` times the mean (a step waits for each layer's busiest device)."""
  return float(np.minimum(np.asarray(series_SxL), factor).mean())


def replay_policy(cfg: Config, policy: str, counts_SxLxWxE: np.ndarray,
                  devices: int) -> dict:
  """The policy on the routing: `capacity_factor` (dense: the smallest with <= 1% dropped;
  ragged: the receive buffer's factor), `series` (each step's and layer's busiest device's
  routed rows over the mean), `busiest_over_mean` (`busiest` of it at that factor), the
  planner's
  `planner_ms_per_layer` (mean decision), `decisions`, `switches`, `migration_s` and
  `migrated_bytes` over the replay, and the replay's max/mean percentiles."""
  counts = np.asarray(counts_SxLxWxE)
  steps, layers, sources, experts = counts.shape
  choices = int(counts[0, 0, 0].sum())                          # T*K of one source
  pcfg = policy_config(cfg, policy, devices)
  if policy == "ragged":
    loads = static_loads(counts, devices)
    factor = ragged_factor(loads, choices)
    rows = math.ceil(factor * choices)
    mm = loads.max(-1) / loads.mean(-1)
    return {"capacity_factor": factor, "busiest_over_mean": busiest(mm, rows / choices),
            "series": mm,
            "max_over_mean_median": float(np.median(mm)), "max_over_mean_p99":
            float(np.percentile(mm, 99)), "planner_ms_per_layer": None, "decisions": 0,
            "switches": 0, "migration_s": 0.0, "migrated_bytes": 0, "steps": steps,
            "layers": layers}
  planner = online_planner(pcfg, devices)
  mode, _, shares = POLICIES[policy]
  slots = fsep_slots(pcfg, devices) if mode == "fsep" else experts // devices
  r = replay_trainer(counts, planner, slots, shares=shares)
  factor = r["needed_capacity_factor"][CAPACITY]
  slot_factor = r["needed_capacity_factor"]["slot"]
  series = np.asarray(r["series"])                              # [S, L] max/mean, routed
  timed = decision_time(cfg, policy, counts, devices) if planner.active else {}
  return {"capacity_factor": factor, "busiest_over_mean": busiest(series, factor),
          "slot_capacity_factor": slot_factor,     # per-(source, slot) buffers' (the einsum's)
          "series": series, "decision": timed,
          "max_over_mean_median": r["median"], "max_over_mean_p99": r["p99"],
          "planner_ms_per_layer": r["planner_ms_mean"] if planner.active else None,
          "planner_ms_max": r["planner_ms_max"] if planner.active else None,
          "decisions": r["decisions"] if planner.active else 0, "switches": r["switches"],
          "migration_s": r["migration_s"], "migrated_bytes": r["migrated_bytes"],
          # A re-plan is considered after every finished step where the planner is adaptive
          # (the trainer's default for fsep, whose switches move nothing), else every X.
          "every": (1 if planner.adaptive else planner.every) if planner.active else None,
          "adaptive": planner.adaptive, "slots": slots, "steps": steps,
          "layers": layers, "profile": pcfg.strategy.profile,
          "options": {k: v for k, v in dataclasses.asdict(planner.options).items()
                      if isinstance(v, (int, float, str, bool))}}
