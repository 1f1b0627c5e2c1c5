"""How many collective calls one compiled train step makes, and over how many devices each.

At small sizes a step is latency-bound, so the count decides the cost model's reduce and
tensor-parallel terms. The counts are those of the compiled train steps on 8 CPU devices
(`build_program` on the default model; tests/hlo.py's `collective_calls`, checked by
tests/test_strategy_calls.py for flat ep, fsep, a model-parallel and two P=2 strategies):
XLA's all-reduce combiner (`AllReduceCombiner`; on GPU its bucket is
`--xla_gpu_all_reduce_combine_threshold_bytes`, by default XLA's
kDefaultAllReduceCombineThreshold, 30 MiB) merges independent all-reduces over the same
devices into one tuple all-reduce, so a layer group's gradients leave the backward scan as
one call per iteration, not one per leaf, and a MoE layer's router statistics as one call.
A pipelined step runs its stage's layer groups once per tick (moejax/strategy/stages.py), and
under FSDP and remat gathers their parameters in every tick (`fsdp_gathers`).
"""

from __future__ import annotations

import math

from moejax.strategy import stages

COMBINE_BYTES = 30 * 2**20
# Per MoE layer run over data x expert: the router statistics (fractions, probabilities,
# z-loss) in one combined all-reduce, forward. With an expert axis also over `expert`: the
# routed counts forward and the statistics' transpose backward.
STATS_PER_RUN = 1
EXPERT_PER_RUN = 2
# Once per step over data x expert: the gradients of what no layer scan holds (embedding,
# head, final norm) with the loss in one bucket, and the metrics the host reads (the expert
# counts summed: one all-reduce; counts, drops and layout rows gathered: about five
# all-gathers).
STEP_SHARD_CALLS = 7
# Tensor parallel, per layer group run: two activation psums a layer forward and two backward,
# and one more in a MoE layer's backward (its router and expert-input cotangents).
TP_PER_LAYER = 4
TP_PER_MOE_LAYER = 1
# Once per step over `model`: the vocabulary-sharded head's log-softmax (max, sum, the
# label gather's transpose), its weight gradient and two scalar metric reductions.
TP_PER_STEP = 6
# Once per step over `stage`: the per-layer metrics of every stage's layers gathered.
STAGE_METRIC_CALLS = 8
# Token exchange per MoE layer run: dispatch and combine forward and their transposes; a
# layer recomputed for the backward without its exchanges kept runs the two forward ones again
# (exchanges_per_run).
A2A_PER_RUN = 4
A2A_RECOMPUTED = 2
# fsep restores three weights forward, again for the backward and returns their gradients
# (3 x 3 all_to_alls a run), and once a step outside the scans: the first layer's three
# forward, the last layer's three for the backward (the seed of the backward's restore-ahead;
# not under pipeline stages, which restore per chunk) and the first layer's three gradients
# back.
RESTORE_PER_RUN = 9
RESTORE_PER_STEP = 9


def recomputes_moe(strategy, w) -> bool:
  """Whether the backward recomputes each MoE layer's forward: fsep's layer always does, in
  its own backward pass (moejax.model.moe.fsep_backward; not under pipeline stages, whose
  fsep backward is plain autodiff), an ep layer under remat."""
  if strategy.expert_mode == "fsep":
    return strategy.stage == 1
  return bool(w.remat)


def keeps_exchange(strategy, w) -> bool:
  """Whether `model.remat_keeps_exchange` applies: a recomputed MoE layer whose exchanges are
  the named dense all_to_all (not ragged dispatch's)."""
  return bool(w.remat_keeps_exchange) and strategy.dispatch == "dense" and recomputes_moe(
      strategy, w)


def exchanges_per_run(strategy, w) -> int:
  """Token all_to_alls per MoE layer run (the grouped paths' integer counts aside)."""
  again = recomputes_moe(strategy, w) and not keeps_exchange(strategy, w)
  return A2A_PER_RUN + (A2A_RECOMPUTED if again else 0)


def restore_per_step(stages: int) -> int:
  return RESTORE_PER_STEP if stages == 1 else RESTORE_PER_STEP - 3


def buckets(grad_bytes: float, combine_bytes: float = COMBINE_BYTES) -> int:
  """Combined all-reduces of `grad_bytes` of independent gradients."""
  return max(1, math.ceil(grad_bytes / combine_bytes))


def reduce_calls(strategy, runs: float, group_bytes: float, expert_group_bytes: float,
                 fsdp_runs: float = 0) -> list[tuple[float, int]]:
  """[(calls, devices in each)] of the gradient reduce, router statistics, metrics and FSDP
  gathers of one step; `runs` MoE layer (= layer group) runs per device, `group_bytes` the
  gradient bytes of one group reduced over data x expert, `expert_group_bytes` those of its
  experts reduced over data alone (expert axis > 1), `fsdp_runs` how many times a step
  gathers a layer group under FSDP per pass (`stages.gather_runs` x the stage's groups)."""
  dd, n, p = strategy.data, strategy.expert, strategy.stage
  shards, out = dd * n, []
  if shards > 1:
    out.append((runs * (STATS_PER_RUN + buckets(group_bytes)) + STEP_SHARD_CALLS, shards))
  if n > 1:
    # With no data axis and no stages the expert group is the data x expert group, and XLA's
    # combiner merges the forward's routed counts into the statistics' all-reduce: one call
    # a run fewer (fsep/1x8x1 compiles 12 calls; a pipeline's stage vmap keeps them apart).
    merged = runs if dd == 1 and p == 1 else 0
    out.append((runs * EXPERT_PER_RUN - merged, n))
    if dd > 1:
      out.append((runs * buckets(expert_group_bytes), dd))
  if p > 1:
    out.append((STAGE_METRIC_CALLS, p))
  if fsdp_runs and dd > 1:   # each group's parameters gathered per pass, and the rest's
    out.append((stages.FSDP_PASSES * (fsdp_runs + 1), dd))
  return out


def tp_calls(layers: float, moe_layers: float, runs_per_layer: float) -> float:
  """Tensor-parallel psums of one step: `layers`, `moe_layers` of a stage, each run
  `runs_per_layer` times (the ticks / V of a pipelined step, 1 without stages)."""
  return (TP_PER_LAYER * layers + TP_PER_MOE_LAYER * moe_layers) * runs_per_layer + TP_PER_STEP


def fsdp_gathers(strategy, w) -> float:
  """FSDP's gathers of the layer groups' parameters in one step, forward and backward: per
  group run under remat (every tick of a pipeline), once a step per group without it
  (moejax.strategy.stages.gather_runs). One call a group and pass: XLA:GPU's all-gather
  combiner merges a group's leaves into a few (4 a pass in configs/gpt_moe_gpu.gin's groups on
  compile-only H100s); XLA:CPU merges none, one call a gathered leaf
  (tests/test_strategy_calls.py checks that the calls follow the runs)."""
  if not strategy.fsdp or strategy.data == 1:
    return 0.0
  p = strategy.stage
  return stages.FSDP_PASSES * stages.gather_runs(p, strategy.microbatches, strategy.virtual,
                                                 w.remat) * w.moe_layers / p


def collective_counts(strategy, w) -> dict[str, float]:
  """{opcode family: calls per step} as tests/hlo.py's `collective_calls` reads them from the
  compiled step: "reduce" = all-reduce + all-gather + reduce-scatter (stage reduces
  included), "all-to-all", "collective-permute"."""
  p, mb, v = strategy.stage, strategy.microbatches, strategy.virtual
  per_tick = stages.ticks(p, mb, v) / v
  runs = w.moe_layers / p * per_tick
  gathers = fsdp_gathers(strategy, w) / stages.FSDP_PASSES
  reduce = sum(c for c, _ in reduce_calls(strategy, runs, 1.0, 1.0, gathers))
  if strategy.model > 1:
    reduce += tp_calls(w.num_layers / p, w.moe_layers / p, per_tick)
  sends = 0.0
  if p > 1:
    reduce += stages.REDUCES_PER_STEP
    sends = stages.SENDS_PER_TICK * stages.ticks(p, mb, v) + stages.SENDS_PER_STEP
  a2a = 0.0
  if strategy.expert > 1:
    a2a = exchanges_per_run(strategy, w) * runs
    if strategy.expert_mode == "fsep":
      a2a += RESTORE_PER_RUN * runs + restore_per_step(p)
  return {"reduce": reduce, "all-to-all": a2a, "collective-permute": sends}
