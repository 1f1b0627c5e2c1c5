"""The cost model's collective call counts against the compiled train steps' own."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from moejax.aot import read
from moejax.aot.hlo import op_name, parse as parse_hlo
from moejax.config import Config
from moejax.strategy import calls, offline
from moejax.strategy.cost import PRESETS, predict_step
from moejax.strategy.spec import parse
from tests.hlo import collective_calls

CFG = Config()
W = offline.workload_of(CFG)
# {spec: (all-reduce + all-gather + reduce-scatter, all-to-all, collective-permute)} per step
# of build_program(Config(), spec).train_step on 8 CPU devices (the slow test
# below reads them again from the compiler): flat ep, fsep, a model-parallel one, two P=2.
PROGRAM = {"ep/8x1x1/cf1.5": (11, 0, 0), "fsep/1x8x1/c2/cf1.5": (12, 39, 0),
           "ep/2x2x2/cf1.25": (41, 8, 0), "ep/1x4x1/p2/m2/cf1.25": (29, 12, 8),
           "ep/1x1x4/p2/m2/cf1.25": (43, 0, 8)}


# FSDP under remat (Config() with model.remat): {spec: (all-gathers over `data` in the layer
# loops, their bytes a step with the once-a-step ones, the larger buffer of each)} of the same
# compiled steps: no pipeline, microbatches alone (the train step's loop, in which the
# embedding's row lookup gathers once a microbatch: not a layer's), two stages. Each group run
# gathers the group's parameters in its forward and again in its backward (the recomputed forward's
# gather serves the backward's matmuls), in every tick: 42 calls a run, XLA:CPU combining no
# all-gathers (21 leaves a group and pass).
REMAT_CFG = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, remat=True))
REMAT_W = offline.workload_of(REMAT_CFG)
FSDP_PROGRAM = {"ep/4x2x1/cf1.25/fsdp": (84, 11826368),
                "ep/4x2x1/m2/cf1.25/fsdp": (168, 23262400),
                "ep/2x2x1/p2/m2/cf1.25/fsdp": (126, 17739536),
                # fsep: each layer's C restored slots gathered whole (C = 8 by default here,
                # twice the E/N = 4 stored experts ep gathers), in the backward with their
                # restore a layer ahead, one layer more (the first layer's run gathers the wrap)
                "fsep/4x2x1/cf1.25/fsdp": (82, 21262528),
                "fsep/4x2x1/c4/cf1.25/fsdp": (82, 13398208)}
LEAVES_GATHERED = 21


def _close(predicted: float, program: int) -> bool:
  """Within one call, or 10% of many: XLA may merge or split a small reduce differently."""
  return abs(predicted - program) <= max(1.0, 0.1 * program)


@pytest.mark.parametrize("spec", sorted(PROGRAM))
def test_counts_are_the_compiled_programs(spec):
  got = calls.collective_counts(parse(spec), W)
  reduce, a2a, sends = PROGRAM[spec]
  assert _close(got["reduce"], reduce), (spec, got, PROGRAM[spec])
  assert got["all-to-all"] == a2a and got["collective-permute"] == sends, (spec, got)


def _fsdp_within(spec: str, loop_gathers: int, gathered_bytes: int):
  """The model's FSDP gathers against a compiled step's: the calls in the layer loops follow
  the model's gathers (LEAVES_GATHERED calls each on XLA:CPU) and the bytes a device
  receives, (data - 1) / data of the gathered buffers, are the model's within 5%."""
  strategy = parse(spec)
  model_calls = calls.fsdp_gathers(strategy, REMAT_W) * LEAVES_GATHERED
  if strategy.expert_mode == "ep":
    assert model_calls == loop_gathers, spec
  else:   # fsep gathers restored slots, not stored leaves: the program has 82 of the 84 calls
    assert _close(model_calls, loop_gathers), (spec, model_calls, loop_gathers)
  received = gathered_bytes * (strategy.data - 1) / strategy.data
  predicted = predict_step(strategy, REMAT_W, PRESETS["cpu"]).gather_bytes
  assert abs(predicted / received - 1) < 0.05, (spec, predicted, received)


@pytest.mark.parametrize("spec", sorted(FSDP_PROGRAM))
def test_fsdp_gathers_are_the_compiled_programs(spec):
  """Pipelined and microbatched FSDP gathers each group in every tick (the ticks' runs), not
  once a step: the stages' and microbatches' steps gather M + P - 1 and M times the bytes."""
  _fsdp_within(spec, *FSDP_PROGRAM[spec])


def test_gradients_reduce_in_combined_buckets_per_group_run():
  assert calls.buckets(1.0) == 1 and calls.buckets(calls.COMBINE_BYTES) == 1
  assert calls.buckets(calls.COMBINE_BYTES + 1) == 2
  flat = parse("ep/8x1x1/cf1.5")   # data only: statistics + bucket per run, once-a-step calls
  assert calls.reduce_calls(flat, 2, 1e6, 1e6) == [(2 * 2 + calls.STEP_SHARD_CALLS, 8)]
  big = calls.reduce_calls(flat, 2, 3.5 * calls.COMBINE_BYTES, 0)
  assert big == [(2 * (1 + 4) + calls.STEP_SHARD_CALLS, 8)]
  assert calls.reduce_calls(parse("ep/1x1x8/cf1"), 2, 1e6, 1e6) == []   # nothing to reduce
  fsdp = calls.reduce_calls(parse("ep/2x4x1/cf1.25/fsdp"), 2, 1e6, 1e6, fsdp_runs=2)
  assert (2 * 3, 2) in fsdp and (2 * 1, 2) in fsdp   # gathers per pass; expert bucket


def test_reduce_term_prices_the_programs_calls():
  """The call count decides a latency-bound step: ep/8x1x1's reduce is its 11 calls, not
  the 48 (12 per MoE layer run + one per gradient leaf) of the model before decision 0055."""
  prof = PRESETS["h100_node"]
  cost = predict_step(parse("ep/8x1x1/cf1.5"), W, prof)
  latency = 11 * prof.call_s(8)
  assert latency <= cost.reduce_s <= latency + 0.2e-3   # + the volume beyond the matmuls'
  p2 = predict_step(parse("ep/1x1x4/p2/m2/cf1.25"), W, prof)
  assert p2.total_s > cost.total_s


@pytest.mark.slow
def test_counts_read_from_the_compiler():
  """Compiles the five strategies' train steps (about a minute each on the 2-core VM) and
  compares the model's counts with the compiler's, as the fast test does with the table."""
  from moejax.train.optim import optimizer, schedule
  from moejax.train.programs import build_program
  tx, lr = optimizer(CFG.optim, 10), schedule(CFG.optim, 10)
  for spec in PROGRAM:
    hlo = build_program(CFG, parse(spec), tx, lr, jax.devices()).train_step.as_text()
    got = collective_calls(hlo)
    read = (got.get("all-reduce", 0) + got.get("all-gather", 0) + got.get("reduce-scatter", 0),
            got.get("all-to-all", 0), got.get("collective-permute", 0))
    predicted = calls.collective_counts(parse(spec), W)
    assert _close(predicted["reduce"], read[0]), (spec, got, predicted)
    assert (predicted["all-to-all"], predicted["collective-permute"]) == read[1:], (spec, got)


@pytest.mark.slow
def test_fsdp_gathers_read_from_the_compiler():
  """Compiles the FSDP steps under remat and reads their all-gathers over `data`: the
  calls in the layer loops (run more than once a step) and every one's bytes."""
  from moejax.train.optim import optimizer, schedule
  from moejax.train.programs import build_program
  tx, lr = optimizer(CFG.optim, 10), schedule(CFG.optim, 10)
  for spec in FSDP_PROGRAM:
    strategy = parse(spec)
    module = parse_hlo(build_program(REMAT_CFG, strategy, tx, lr,
                                     jax.devices()).train_step.as_text())
    comps = {name: module.by_name(name) for name in module.computations}
    gathers = [c for c in read.collectives(module) if c.kind == "all-gather" and
               read.group_size(comps[c.computation][c.name].line) == strategy.data]
    in_loops = sum(c.runs for c in gathers if c.runs > 1 and
                   "embed" not in op_name(comps[c.computation][c.name].line))
    _fsdp_within(spec, in_loops, sum(c.runs * c.bytes for c in gathers))
