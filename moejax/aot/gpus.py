"""The GPUs a program can be compiled for here, and their compile-only devices.

A target is a `GpuTargetConfigProto` in text form (`targets/<name>.txtpb`): the facts XLA:GPU
compiles against (SM count, shared memory, registers, HBM size and bandwidth, compute
capability, CUDA runtime and cuDNN versions). `compile_only_devices` turns one into a
topology of devices that can be compiled for but hold no data: "1x1x8" is one host of 8 GPUs,
"8x1x8" eight such hosts (the fields are slices x hosts per slice x devices per host).
What a GPU sustains (the estimates' rates) is moejax.strategy.hardware's table.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib
import re

from moejax.config import ConfigError

TARGETS = pathlib.Path(__file__).resolve().parent / "targets"


# The targets (moejax/aot/targets/NAME.txtpb); the *_real_* files are dumps of real GPUs kept
# beside them, which this jax may not parse.
GPUS = ("h100", "h200")


@dataclasses.dataclass(frozen=True)
class Gpu:
  name: str
  memory_bytes: float            # device memory XLA may use (the target's device_memory_size)


def target_config(name: str) -> str:
  """The target's GpuTargetConfigProto text."""
  if name not in GPUS:
    raise ConfigError(f"gpu={name!r} has no compile target; use one of {list(GPUS)} (or add "
                      f"moejax/aot/targets/{name}.txtpb and name it in moejax.aot.gpus.GPUS).")
  return (TARGETS / f"{name}.txtpb").read_text()


@functools.cache
def gpu(name: str) -> Gpu:
  """GPU `name` as its target describes it."""
  memory = re.search(r"device_memory_size:\s*(\d+)", target_config(name))
  return Gpu(name, float(memory.group(1)))


def has_cuda_plugin() -> str | None:
  """None if JAX's CUDA plugin is installed, else why not (one line)."""
  if importlib.util.find_spec("jax_plugins") is not None and (
      importlib.util.find_spec("jax_plugins.xla_cuda12") or
      importlib.util.find_spec("jax_plugins.xla_cuda13")):
    return None
  return "JAX's CUDA plugin is not installed: pip install -e '.[gpu-aot]'"


def parse_topology(topology: str) -> tuple[int, int, int]:
  try:
    slices, hosts, per_host = (int(v) for v in topology.split("x"))
  except ValueError:
    raise ConfigError(f"topology={topology!r} must be SLICESxHOSTSxGPUS, e.g. '1x1x8' (one "
                      "host of 8 GPUs) or '8x1x8' (8 hosts).") from None
  return slices, hosts, per_host


def cpu_unless_chosen() -> None:
  """On a host without a GPU, JAX starts on CPU unless the user chose platforms
  (JAX_PLATFORMS): compile-only devices need no GPU platform, and JAX's CUDA plugin, started
  where there is no GPU (or other CUDA libraries), fails, and takes the compile-only topology
  with it. No effect once JAX's backends have started."""
  import jax

  if (not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms and
          not os.path.exists("/dev/nvidiactl")):
    jax.config.update("jax_platforms", "cpu")


@functools.cache
def compile_only_devices(name: str = "h100", topology: str = "1x1x8") -> tuple:
  """The devices of `topology` of GPU `name`, compile-only (no data can be put on them)."""
  from jax.experimental import topologies

  parse_topology(topology)
  if why := has_cuda_plugin():
    raise ConfigError(why)
  cpu_unless_chosen()
  try:
    desc = topologies.get_topology_desc(platform="cuda", target_config=target_config(name),
                                        topology=topology)
  except NotImplementedError as e:   # the CUDA plugin failed when JAX started
    raise ConfigError(f"no compile-only CUDA topology ({e}): JAX started its CUDA plugin, which "
                      "failed on this host; set JAX_PLATFORMS=cpu before JAX starts.") from None
  return tuple(desc.devices)


def host_size(topology: str) -> int:
  """GPUs per host: collectives within one host run on NVLink."""
  return parse_topology(topology)[2]
