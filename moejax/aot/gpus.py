"""The GPUs a program can be compiled for here, and their compile-only devices.

A target is a `GpuTargetConfigProto` in text form (`targets/<name>.txtpb`): the facts XLA:GPU
compiles against (SM count, shared memory, registers, HBM size and bandwidth, compute
capability, CUDA runtime and cuDNN versions). `compile_only_devices` turns one into a
topology of devices that can be compiled for but hold no data: "1x1x8" is one host of 8 GPUs,
"8x1x8" eight such hosts (the fields are slices x hosts per slice x devices per host).
The rates beside each target are the published peaks the schedule estimate uses.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib

from moejax.config import ConfigError

TARGETS = pathlib.Path(__file__).resolve().parent / "targets"


@dataclasses.dataclass(frozen=True)
class Gpu:
  name: str
  memory_bytes: float            # device memory XLA may use (the target's device_memory_size)
  bf16_flops_per_s: float        # dense bf16 tensor-core peak
  hbm_bytes_per_s: float         # HBM peak
  nvlink_bytes_per_s: float      # NVLink, one direction, per GPU (within a host)
  fabric_bytes_per_s: float      # the inter-host network per GPU (one 400 Gb/s NIC each)


# NVIDIA's datasheets (SXM parts): 989 TFLOP/s dense bf16; HBM3 3.35 TB/s (H100),
# HBM3e 4.8 TB/s (H200); NVLink 4 900 GB/s both directions (450 per direction); one
# ConnectX-7 400 Gb/s (50 GB/s) NIC per GPU in DGX/HGX nodes.
GPUS = {
    "h100": Gpu("h100", 85520809984, 989e12, 3.35e12, 450e9, 50e9),
    "h200": Gpu("h200", 150754820096, 989e12, 4.8e12, 450e9, 50e9),
}


def gpu(name: str) -> Gpu:
  if name not in GPUS:
    raise ConfigError(f"gpu={name!r} has no compile target; use one of {sorted(GPUS)} "
                      f"(or add moejax/aot/targets/{name}.txtpb and a GPUS entry).")
  return GPUS[name]


def target_config(name: str) -> str:
  """The target's GpuTargetConfigProto text."""
  return (TARGETS / f"{gpu(name).name}.txtpb").read_text()


def has_cuda_plugin() -> str | None:
  """None if JAX's CUDA plugin is installed, else why not (one line)."""
  if importlib.util.find_spec("jax_plugins") is not None and (
      importlib.util.find_spec("jax_plugins.xla_cuda12") or
      importlib.util.find_spec("jax_plugins.xla_cuda13")):
    return None
  return "JAX's CUDA plugin is not installed: pip install -e '.[gpu_aot]'"


def parse_topology(topology: str) -> tuple[int, int, int]:
  try:
    slices, hosts, per_host = (int(v) for v in topology.split("x"))
  except ValueError:
    raise ConfigError(f"topology={topology!r} must be SLICESxHOSTSxGPUS, e.g. '1x1x8' (one "
                      "host of 8 GPUs) or '8x1x8' (8 hosts).") from None
  return slices, hosts, per_host


@functools.cache
def compile_only_devices(name: str = "h100", topology: str = "1x1x8") -> tuple:
  """The devices of `topology` of GPU `name`, compile-only (no data can be put on them)."""
  from jax.experimental import topologies

  parse_topology(topology)
  if why := has_cuda_plugin():
    raise ConfigError(why)
  desc = topologies.get_topology_desc(platform="cuda", target_config=target_config(name),
                                      topology=topology)
  return tuple(desc.devices)


def host_size(topology: str) -> int:
  """GPUs per host: collectives within one host run on NVLink."""
  return parse_topology(topology)[2]
