"""The pipeline's and FSDP's terms of the step cost model (pure arithmetic).

moejax runs a pipelined step as one scan over V*M + P - 1 ticks (moejax/model/pipeline.py):
at every tick every stage runs 1/V of its layer groups on one microbatch, idle stages on
values nobody reads, so a stage's work is its busy ticks' times ticks / (V*M); the
difference, the bubble, is (P-1) / (V*M + P-1) of the step (GPipe: V = 1; the circular
schedule: V chunks per stage). Between ticks each stage's microbatch moves to the next stage
(a collective permute over `stage`, whose wrap-around pair hands the last stage's output to
stage 0); the backward pass sends it back. Once per step the last output makes one more
rotation and stage 0's finished microbatches go to every stage's head. Under FSDP the
parameters are gathered over `data` where they are used (forward, and the backward, whose
recomputed forward under remat gathers them for both), a pipeline's layer groups in every
tick under remat, and the gradients are reduce-scattered instead of all-reduced.
"""

from __future__ import annotations

import numpy as np

# Read from the compiled loss-and-gradient programs on 8 CPU devices (tests/hlo.py's
# loop_sends, asserted by tests/test_pipeline.py and tests/test_pipeline_schedules.py: GPipe
# at P=2 x expert 4 and P=4 x expert 2, circular V=2 at P=2 x expert 2): the forward tick loop
# has one collective permute of one microbatch's rows per iteration (the rotation), the
# backward loop one (its transpose); the same for both schedules. (Before decision 0050 it was
# 6: the last stage's output was also broadcast to every stage each tick, forward and back.)
SENDS_PER_TICK = 2
# Once per step, outside the loops: the last rotation, forward and back, and two all-reduces
# over `stage` of all M microbatches' rows: the collection of stage 0's outputs, and in the
# backward the sum over stages of the embedding output's cotangent (every stage holds a copy
# of the microbatches; only stage 0's is read).
SENDS_PER_STEP = 2
REDUCES_PER_STEP = 2


def ticks(stages: int, microbatches: int, virtual: int = 1) -> int:
  """Ticks of one pipelined step: V*M + P - 1 (M with no pipeline)."""
  return virtual * microbatches + stages - 1


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
  """Share of the ticks a stage spends on no microbatch: (P-1) / (V*M + P-1); GPipe is V=1,
  the circular schedule V > 1 (Megatron's interleaved figure, (P-1) / (V*M), counts the
  bubble against the busy ticks instead of all of them)."""
  return (stages - 1) / ticks(stages, microbatches, virtual)


def stretch(stages: int, microbatches: int, virtual: int = 1) -> float:
  """A stage's step time over its busy ticks': ticks / (V*M) = 1 / (1 - bubble)."""
  return ticks(stages, microbatches, virtual) / (virtual * microbatches)


def stage_of_group(groups: int, stages: int, virtual: int = 1) -> np.ndarray:
  """[groups] the stage each scanned layer group runs on: P*V chunks of consecutive groups,
  chunk c on stage c % P (V = 1: stage s holds groups s*G/P .. (s+1)*G/P - 1)."""
  chunk = max(groups // (stages * virtual), 1)
  return (np.arange(groups) // chunk) % stages


def busiest_stage(per_group: np.ndarray, stages: int, virtual: int = 1) -> float:
  """The largest per-stage sum of a per-group quantity (the stage the others wait for)."""
  per_group = np.asarray(per_group, np.float64)
  owner = stage_of_group(len(per_group), stages, virtual)
  return float(np.bincount(owner, per_group, minlength=stages).max())


def transfer_seconds(stages: int, microbatches: int, virtual: int, tokens: float,
                     d_model: int, act_bytes: int, call_s: float, bytes_per_s: float) -> float:
  """Stage-boundary traffic of one step: per tick SENDS_PER_TICK transfers of one device's
  microbatch rows (the rotation, forward and backward), and once per step SENDS_PER_STEP more
  and REDUCES_PER_STEP ring all-reduces over the P stages of all M microbatches' rows."""
  if stages == 1:
    return 0.0
  send = tokens / microbatches * d_model * act_bytes
  sends = SENDS_PER_TICK * ticks(stages, microbatches, virtual) + SENDS_PER_STEP
  reduce = call_s + 2 * (stages - 1) / stages * microbatches * send / bytes_per_s
  return sends * (call_s + send / bytes_per_s) + REDUCES_PER_STEP * reduce


# FSDP gathers a layer group's parameters twice per run of the group: in the forward, and in
# the backward (under remat the recomputed forward's gather serves the backward's matmuls too).
# Read from the compiled train steps on 8 CPU devices (tests/test_strategy_calls.py): the
# forward and backward layer loops each gather the group's bytes once an iteration, with or
# without remat, whose iterations are the groups times the ticks / V of a pipelined step.
FSDP_PASSES = 2


def fsdp_gather_bytes(param_bytes: float, shards: int, runs: float = 1.0,
                      passes: int = FSDP_PASSES) -> float:
  """Bytes a device receives gathering `param_bytes` over `shards` data devices in `passes`
  passes (forward and backward), `runs` times each: a pipeline's layer groups are gathered
  in every tick under remat (decision 0113: each group's weights are tied to its input inside
  the tick loop), once a step otherwise (JAX's scan linearization hoists the weight-only
  gathers out of the tick loop), and the embedding, head and dense first blocks once a step."""
  if shards == 1:
    return 0.0
  return passes * runs * param_bytes * (shards - 1) / shards


def gather_runs(stages: int, microbatches: int, virtual: int, remat: bool) -> float:
  """How many times a step gathers a layer group's parameters per pass under FSDP: once a
  tick it runs in (ticks / V) under remat, once a step without it (hoisted)."""
  return ticks(stages, microbatches, virtual) / virtual if remat else 1.0
