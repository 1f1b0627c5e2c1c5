"""The program XLA:GPU compiles for 8 H100s, read on this CPU host (moejax.aot; the
`gpu-aot` extra): configs/gpt_moe_gpu.gin at its own sizes (benchmarks.gpu.gpu_program's
families), compiled for a compile-only topology with the flags train.py sets on GPU. At the
config's sizes a compile takes no longer than at tiny ones (30-110 s on a loaded 2-core
host: the op count, not the sizes, sets it), and the memory model is checked where its
terms matter.

- fsep: every restore all-to-all, forward and backward, is async with compute scheduled
  between its start and done, remat on and off, with the flag that allows eight collectives
  in flight and without it; the backward pass's weight restores are hidden (the schedule
  estimate exposes at most 10% of their transfer).
- exchange chunks 2: piece 0's return exchange overlaps piece 1's expert matmuls.
- ragged + pallas: the program's custom calls are the Pallas kernels the layer asks for.
- the arithmetic memory model (moejax.strategy.memory) is within 10% of XLA's peak for five
  families (ep pooled, fsep, fsdp, exchange chunks, pipeline stages); ragged + pallas is a
  strict xfail (XLA's heap is larger than the buffers live at its peak).
All are `slow`; the compiled programs are shared between tests.
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

from moejax.aot import gpus, read
from moejax.runtime.xla_flags import GPU_FLAGS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(gpus.has_cuda_plugin() is not None,
                                 reason=str(gpus.has_cuda_plugin()))]
OVERLAP_FLAG = "--xla_gpu_experimental_parallel_collective_overlap_limit=8"


def _compiled(family: str, bindings: tuple[str, ...] = (), flags: tuple[str, ...] = GPU_FLAGS):
  """The family's program, compiled once per (family, bindings, flags) in this process."""
  return _compile(family, tuple(bindings), tuple(flags))


@functools.cache
def _compile(family: str, bindings: tuple[str, ...], flags: tuple[str, ...]):
  from benchmarks.gpu.gpu_program import family_config
  from moejax.aot import compile_train_step

  cfg = family_config(family, "1x1x8", list(bindings))
  return compile_train_step(cfg, gpu="h100", topology="1x1x8", flags=flags)


def _remat(on: bool) -> tuple[str, ...]:
  """Bindings for model.remat (the config's own is on: no binding, one compiled program)."""
  return () if on else ("model.remat = False",)


def _restores(gp) -> list[read.Collective]:
  return [c for c in read.collectives(gp.hlo) if "fsep_restore" in c.op_name]


@pytest.mark.parametrize("remat", [True, False])
def test_fsep_restores_overlap_compute_forward_and_backward(remat):
  restores = _restores(_compiled("fsep_planned", _remat(remat)))
  forward = [c for c in restores if not c.backward]
  backward = [c for c in restores if c.backward]
  assert forward and backward, [c.op_name for c in restores]
  for c in restores:
    assert c.kind == "all-to-all" and c.is_async, (c.name, c.op_name)
    assert c.compute_between, f"{c.name} ({c.op_name}) has no compute between start and done"


@pytest.mark.parametrize("remat", [True, False])
def test_fsep_backward_restores_are_hidden_by_design(remat):
  """Layer l's backward restores layer l-1's weights (moejax.model.moe.fsep_backward's
  `_prefetching_moe`): by the schedule estimate at most 10% of the backward weight restores'
  transfer time is exposed, and at least 90% of the step's collective bytes overlap compute.
  (Their transposes, the gradients' return, are `restore_gradient`: the last layer's runs
  after all backward compute, at the step's tail.)"""
  from moejax.aot.estimate import estimate

  gp = _compiled("fsep_planned", _remat(remat))
  est = estimate(gp.hlo, "h100", "1x1x8")
  transfer = est.comm_by["restore_backward"]
  assert transfer > 0
  assert est.exposed_by.get("restore_backward", 0.0) <= 0.1 * transfer, est.exposed_by
  assert read.overlapped_bytes_fraction(read.collectives(gp.hlo)) >= 0.9


def test_fsep_under_fsdp_gathers_backward_weights_a_layer_ahead():
  """Under FSDP the weights the backward restores a layer ahead are gathered over `data` with
  their restore (moejax.model.moe.fsep_backward.open_channel), not at the top of the layer
  that uses them, where the token exchange queued behind the gathers: in the backward layer
  loop each restored weight's gather is under the restore's scope with compute between its
  start and done, and no gather of that size is left at the use."""
  from moejax.model.moe.fsep_backward import BACKWARD_RESTORE

  gp = _compiled("fsep_planned", ("mesh.expert = 4", "mesh.fsdp = True"))
  in_loop = [c for c in read.collectives(gp.hlo)
             if c.kind == "all-gather" and c.backward and c.runs > 1]
  ahead = [c for c in in_loop if f"/{BACKWARD_RESTORE}/" in c.op_name]
  assert len(ahead) == 3 and all(c.overlapped for c in ahead), [
      (c.name, c.op_name, len(c.compute_between)) for c in in_loop]
  at_use = [c for c in in_loop if c not in ahead and c.bytes in {a.bytes for a in ahead}]
  assert not at_use, [(c.name, c.op_name) for c in at_use]


@pytest.mark.xfail(reason="under one collective in flight the first layer's forward restore, "
                   "outside the layer scan, has no compute beside it since the blocks before "
                   "the MoE layer are one checkpoint; the trainer's flags overlap every restore "
                   "(the test above)", strict=False)
def test_restores_overlap_compute_with_one_collective_in_flight():
  """Under XLA's default of one async collective in flight (without the flag that allows
  eight) every restore has compute between start and done too: with the backward restoring a
  layer ahead, the flag is not what hides them at the config's sizes (decision 0085)."""
  flags = tuple(f for f in GPU_FLAGS if f != OVERLAP_FLAG)
  assert len(flags) == len(GPU_FLAGS) - 1
  restores = _restores(_compiled("fsep_planned", (), flags))
  assert restores and all(c.is_async and c.compute_between for c in restores), [
      (c.name, c.op_name) for c in restores if not c.compute_between]


def test_chunk0_return_overlaps_chunk1_expert_matmuls():
  """FasterMoE's order (moejax.model.moe.chunks): without the barriers that order the pieces,
  XLA's dot merger fused both pieces' expert matmuls into one and both returns ran after it
  (docs/decisions/0101)."""
  gp = _compiled("ep_chunks2")
  module = read.parse(gp.hlo)
  found = [c for c in read.collectives(module) if c.kind == "all-to-all" and not c.backward
           and "exchange_chunk0/" in c.op_name]
  assert len(found) == 2, [c.op_name for c in found]      # dispatch, then return
  ret = found[1]
  lines = module.by_name(ret.computation)
  matmuls = [n for n in ret.compute_between if "exchange_chunk1/" in lines[n].line and
             "dot_general" in lines[n].line]
  assert ret.is_async and matmuls, [re.search(r'op_name="([^"]*)"', lines[n].line)
                                    for n in ret.compute_between]


def test_ragged_pallas_custom_calls_are_the_layers_kernels():
  """On Hopper in bf16 the grouped matmul is Mosaic GPU's ragged dot (forward and its input
  gradient), the row gathers and the weight gradient Triton kernels; nothing else is a
  custom call. The same program with moe.kernels = 'xla' has none."""
  kernels = read.kernels(_compiled("ep_ragged_pallas").hlo)
  mosaic = {k for k in kernels if k.startswith("mosaic_gpu")}     # its custom-call target
  triton = {k.split(":", 1)[1] for k in kernels if k.startswith("triton:")}
  assert mosaic and triton == {"gather_sum", "gather_dot", "tgmm"}, kernels
  assert set(kernels) == mosaic | {f"triton:{k}" for k in triton}, kernels
  assert read.kernels(_compiled("ep_pooled").hlo) == {}


def test_pooled_xla_experts_scan_the_gpus_tiles():
  """Compiled for GPUs, the pooled layer's static-tile scans run the tiles XLA:GPU's rule
  picks (13 of 2048 rows for the config's 20480-row buffer over 4 slots), not XLA:CPU's 43
  of 512: each tile is a launched loop iteration there."""
  from moejax.aot.hlo import parse
  from moejax.model.moe import tiled
  from moejax.model.moe.pooled import device_capacity

  gp = _compiled("ep_pooled")
  moe, devices = gp.program.cfg.moe, 8
  tokens = gp.program.cfg.data.global_batch_size * gp.program.cfg.data.seq_len // devices
  rows = devices * device_capacity(tokens, moe.top_k, devices, moe.capacity_factor)
  slots = moe.num_experts // devices
  gpu = tiled.num_tiles(rows, slots, tiled.tile_rows(rows, slots, "gpu"))
  cpu = tiled.num_tiles(rows, slots, tiled.tile_rows(rows, slots, "cpu"))
  module = parse(gp.hlo)
  trips = {ins.trip_count() for comp in module.computations.values() for ins in comp
           if ins.opcode == "while"}
  assert (rows, slots, gpu, cpu) == (20480, 4, 13, 43)
  assert gpu in trips and cpu not in trips, trips


# The model's peak / XLA's (benchmarks/gpu/results/gpu_program_h100.json, 8 GPUs): ep_slot 1.01,
# ep_pooled 0.96, fsep 1.04, fsdp 0.98, ep_chunks2 1.04, p2_m4 0.92, ep_ragged_pallas 0.86
# (decision 0099). For ragged, XLA's temp heap is 1.05 GB larger than the buffers its
# live-range analysis finds live at the peak (6.40 GB in all; the model: 6.42 GB).
_PACKING = pytest.mark.xfail(reason="XLA's heap is 1.05 GB over the 6.40 GB live at the ragged "
                             "program's peak; the model counts live buffers", strict=True)


@pytest.mark.parametrize("family", [pytest.param("ep_ragged_pallas", marks=_PACKING),
                                    "ep_pooled", "fsep_planned", "fsdp", "ep_chunks2", "p2_m4"])
def test_memory_model_within_ten_percent_of_xla(family):
  from benchmarks.gpu.gpu_program import model_predictions
  from moejax.aot.summary import peak_bytes

  gp = _compiled(family)
  predicted = model_predictions(gp.program.cfg, gp.program.strategy,
                                "h100_node")["model_memory_bytes"]
  xla = peak_bytes(gp.memory)
  assert abs(predicted / xla - 1) <= 0.10, (family, predicted, xla)


def test_plan_verify_compiles_the_top_candidate(capsys):
  from moejax import plan

  gin = str(pathlib.Path(__file__).resolve().parent.parent / "configs" / "gpt_moe_gpu.gin")
  assert plan.main(["--gin_file", gin, "--devices", "8", "--pool", "1", "--verify", "1",
                    "--gin_bindings", "moe.dispatch = 'dense'",
                    "--gin_bindings", "moe.kernels = 'xla'"]) == 0
  out = capsys.readouterr().out
  lines = out[out.index("verify:"):].splitlines()
  assert "1x1x8 h100" in lines[0], out
  assert lines[2].split()[-1] == "yes" and lines[3].startswith("mean |error|"), lines
  assert lines[4].startswith(f"fastest compiled program that fits: {lines[2].split()[0]}, "), lines
