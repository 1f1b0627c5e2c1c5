"""The real train step of a `Config` and strategy, compiled by XLA:GPU for a GPU topology.

The program is the trainer's own (`moejax.train.programs.build_program`: mesh, model, state
shardings, the jitted step with its donation), lowered with abstract inputs and compiled
with the XLA flags `train.py` sets on GPU (`moejax.runtime.xla_flags.GPU_FLAGS`), passed as
compiler options: XLA_FLAGS is read once per process, and the CPU backend of this process
has already started. On a host with one real GPU, pass `devices=jax.devices()` under
`jax.config.update("jax_mock_gpu_topology", ...)` instead of the compile-only ones: the same
program then compiles with autotuning. On compile-only devices `model.attention = 'auto'`
compiles XLA's attention: cuDNN's fused kernel needs the cuDNN library and a GPU to be built,
so the attention there is not the one a GPU run picks (`GpuProgram.attention` says which).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax

from moejax.aot.gpus import compile_only_devices
from moejax.config import Config
from moejax.runtime.xla_flags import GPU_FLAGS
from moejax.strategy.spec import Strategy, from_config
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import Program, build_program, xla_memory


def xla_options(flags: Sequence[str] = GPU_FLAGS) -> dict[str, Any]:
  """`--name=value` XLA flags as `compile(compiler_options=...)` takes them (booleans and
  integers typed: XLA rejects the string 'true')."""
  options = {}
  for flag in flags:
    name, _, value = flag.lstrip("-").partition("=")
    if value in ("true", "false"):
      options[name] = value == "true"
    elif value.lstrip("-").isdigit():
      options[name] = int(value)
    else:
      options[name] = value
  return options


@dataclasses.dataclass
class GpuProgram:
  """One strategy compiled for a GPU topology: `compiled.as_text()` is XLA:GPU's scheduled
  HLO, `memory` its memory analysis per GPU."""
  program: Program
  compiled: Any
  gpu: str
  topology: str
  lower_s: float
  compile_s: float

  @property
  def attention(self) -> str:
    """The attention implementation compiled (build_program resolved 'auto' on this mesh)."""
    return self.program.cfg.model.attention

  @functools.cached_property
  def hlo(self) -> str:
    return self.compiled.as_text()

  @property
  def memory(self) -> dict[str, int]:
    return xla_memory(self.compiled)


def compile_train_step(cfg: Config, strategy: Strategy | None = None, *, gpu: str = "h100",
                       topology: str = "1x1x8", devices: Sequence | None = None,
                       flags: Sequence[str] = GPU_FLAGS) -> GpuProgram:
  """`strategy` (default: the config's own) applied to `cfg`, its train step compiled for
  `topology` of `gpu` ('h100', 'h200'; moejax/aot/targets) with `flags`. `devices` replaces
  the compile-only topology (e.g. a real GPU's mock topology)."""
  devices = list(compile_only_devices(gpu, topology) if devices is None else devices)
  strategy = strategy or from_config(cfg, len(devices))
  steps = cfg.train.num_steps
  tx, lr = optimizer(cfg.optim, steps), schedule(cfg.optim, steps)
  tick = time.perf_counter()
  prog = build_program(cfg, strategy, tx, lr, devices, compile_now=False)
  cfg = prog.cfg
  batch = jax.ShapeDtypeStruct((cfg.data.global_batch_size, cfg.data.seq_len + 1), "int32",
                               sharding=prog.batch_sharding)
  lowered = prog.train_step.lower(prog.abstract_state(tx), batch, prog.abstract_layout())
  lower_s = time.perf_counter() - tick
  tick = time.perf_counter()
  compiled = lowered.compile(compiler_options=xla_options(flags))
  return GpuProgram(prog, compiled, gpu, topology, lower_s, time.perf_counter() - tick)
