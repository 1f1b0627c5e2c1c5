"""One compiled GPU program in numbers: the row `benchmarks.gpu.gpu_program` writes and
`moejax.plan --verify` prints."""

from __future__ import annotations

from moejax.aot import read
from moejax.aot.compile import GpuProgram
from moejax.aot.estimate import estimate
from moejax.aot.gpus import gpu as gpu_named
from moejax.aot.hlo import parse


def peak_bytes(memory: dict[str, int]) -> int:
  """A GPU's peak from XLA's memory analysis: arguments, outputs not aliased to them, temp."""
  return memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]


def summarize(gp: GpuProgram) -> dict:
  module = parse(gp.hlo)
  found = read.collectives(module)
  est = estimate(module, gp.gpu, gp.topology)
  memory = gp.memory
  return {
      "spec": gp.program.strategy.spec, "topology": gp.topology, "gpu": gp.gpu,
      "compiled": True, "lower_s": round(gp.lower_s, 1), "compile_s": round(gp.compile_s, 1),
      "memory": {k: memory[k] for k in ("argument", "output", "temp", "alias")},
      "peak_bytes": peak_bytes(memory),
      "fits": peak_bytes(memory) <= gpu_named(gp.gpu).memory_bytes,
      "collectives": read.collective_summary(found),
      "async_bytes_fraction": round(read.async_bytes_fraction(found), 4),
      "overlapped_bytes_fraction": round(read.overlapped_bytes_fraction(found), 4),
      "exposed_comm_s": est.exposed_comm_s, "step_s": est.step_s,
      "compute_s": est.compute_s, "comm_s": est.comm_s,
      "comm_s_by": est.comm_by, "exposed_s_by": est.exposed_by,
      "compute_s_by": est.compute_by, "step_s_by_category": est.by_category,
      "kernels": read.kernels(module), "attention": gp.attention,
  }
