"""The XLA_FLAGS train.py sets before JAX starts, when the user set none.

XLA reads XLA_FLAGS once, when JAX creates its first backend, so the choice is made from the
environment and the installed JAX plugins, without asking JAX which devices exist:

  cpu  `--xla_force_host_platform_device_count=N` (N = mesh.host_device_count > 1): N fake
       devices for the mesh, as the tests and benchmarks use. In a run of P processes
       (JAX_NUM_PROCESSES, moejax.runtime.distributed) each fakes N / P when P divides N, so
       the mesh has N devices however many processes share it, as under
       `python -m moejax.launch -n P -d N/P`.
  gpu  XLA's latency-hiding scheduler, so that collectives (the MoE all-to-alls, the
       gradient all-reduces) are scheduled to overlap independent compute, up to eight at
       once; ragged_all_to_all decomposed; XLA's memory limit raised to match the
       allocator's pool, which XLA_PYTHON_CLIENT_MEM_FRACTION sets (see GPU_FLAGS).

A user's XLA_FLAGS (even empty) is left as it is: they replace these defaults entirely.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pkgutil
from collections.abc import Iterable, Mapping

__all__ = ["GPU_FLAGS", "GPU_MEMORY_FRACTION", "default_memory_fraction", "default_xla_flags",
           "installed_jax_plugins", "platform_before_init", "process_count", "set_defaults"]

# Names as XLA's debug_options_flags.cc registers them; XLA aborts at start-up on an unknown
# flag, and tests/test_gpu_config.py starts JAX with these to check the installed jaxlib.
GPU_FLAGS = (
    # Off by default in XLA: without it collectives run where the program order puts them.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # XLA's default today; pinned so that the overlap does not rest on a default: the
    # stream the async collectives run on gets the highest priority.
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # ragged_all_to_all as XLA's decomposition (a dense all-to-all and slices), not its
    # one-shot kernel: on one H100 the kernel took 151 ms a call in the ragged
    # MoE layer and the layer's fwd+bwd fell from 641 ms to 37.5 ms with this flag
    # (docs/decisions/0054-ragged-all-to-all-decomposed-on-gpu.md).
    "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true",
    # Up to 8 async collectives in flight at once (XLA's default: 1). An fsep layer restores
    # its three expert weights with three all-to-alls beside the token dispatch; with one in
    # flight the scheduler serialises them and two of the three restores have no compute
    # between start and done (docs/decisions/0085-four-collectives-in-flight-on-gpu.md).
    # Under FSDP a backward fsep layer also gathers its weights and reduce-scatters their
    # gradients: at 4 the scheduler, which places each done as late as it can, kept a gather,
    # two reduce-scatters and an all-reduce in flight through the layer's last compute and
    # issued the next layer's gathers only at its tail, where they were exposed (Mixtral-
    # 8x7B fsep on 64 compile-only H100s 3.69 -> 3.52 s at 8; static EP unchanged; docs/
    # decisions/0128-fsep-gathers-a-layer-ahead-and-eight-collectives-in-flight.md).
    "--xla_gpu_experimental_parallel_collective_overlap_limit=8",
    # XLA schedules and rematerialises a GPU program to stay under (80% of device memory less
    # the step's inputs and outputs) x this factor / 100; its default, 95, caps an 80 GB H100
    # at about 60.7 GiB, below what JAX's allocator then holds (GPU_MEMORY_FRACTION): Mixtral-
    # 8x7B's fsep step on 64 H100s peaks at 64.0 GiB, and under the default XLA recomputes its
    # gate and up projections, 4.21 -> 3.80 s at 105 (about 66.5 GiB, inside the 71.3 GiB
    # pool; docs/decisions/0127-xla-memory-limit-and-allocator-pool.md).
    "--xla_gpu_memory_limit_slop_factor=105",
)
# The share of each GPU's memory JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION; JAX's
# default is 0.75): XLA's limit above must stay inside it, and the rest is the CUDA context's,
# NCCL's and the libraries' workspaces.
GPU_MEMORY_FRACTION = 0.9
GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def installed_jax_plugins() -> list[str]:
  """Names of the installed JAX PJRT plugins (`xla_cuda12`, ...), found the way JAX finds
  them (the `jax_plugins` namespace package and entry points), without importing them."""
  names = {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
  spec = importlib.util.find_spec("jax_plugins")
  if spec is not None and spec.submodule_search_locations:
    names.update(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))
  return sorted(names)


def platform_before_init(env: Mapping[str, str], plugins: Iterable[str]) -> str:
  """'gpu' or 'cpu': the platform JAX will make its default. JAX_PLATFORMS decides when set
  (its first entry is the default); otherwise a CUDA or ROCm plugin means a GPU."""
  chosen = env.get("JAX_PLATFORMS", "").strip()
  if chosen:
    first = chosen.split(",")[0].strip().lower()
    return "gpu" if first in GPU_PLATFORMS else first
  gpu = any(tag in name.lower() for name in plugins for tag in ("cuda", "rocm"))
  return "gpu" if gpu else "cpu"


def process_count(env: Mapping[str, str]) -> int:
  """P of an explicit multi-process run (`JAX_NUM_PROCESSES` beside the coordinator's address
  and a process id), else 1. Bad values count as 1 here: moejax.runtime.distributed stops on
  them with one line."""
  names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
  if env.get("MOEJAX_DISTRIBUTED") == "0" or not all(n in env for n in names):
    return 1
  count = env["JAX_NUM_PROCESSES"].strip()
  return int(count) if count.isdigit() and int(count) > 0 else 1


def default_memory_fraction(env: Mapping[str, str], platform: str) -> str | None:
  """XLA_PYTHON_CLIENT_MEM_FRACTION to set for `platform`, or None: the user set it, or the
  platform is not a GPU."""
  if platform != "gpu" or "XLA_PYTHON_CLIENT_MEM_FRACTION" in env:
    return None
  return str(GPU_MEMORY_FRACTION)


def default_xla_flags(env: Mapping[str, str], platform: str,
                      host_device_count: int) -> str | None:
  """The XLA_FLAGS to set for `platform`, or None: the user set XLA_FLAGS, or none is needed.
  On GPU the host-device flag is kept when asked for (it only affects the CPU platform)."""
  if "XLA_FLAGS" in env:
    return None
  processes = process_count(env)
  if platform == "cpu" and processes > 1 and host_device_count % processes == 0:
    host_device_count //= processes   # the mesh's devices, shared by the processes
  flags = []
  if host_device_count > 1:
    flags.append(f"--xla_force_host_platform_device_count={host_device_count}")
  if platform == "gpu":
    flags.extend(GPU_FLAGS)
  return " ".join(flags) or None


def set_defaults(environ, platform: str, host_device_count: int) -> list[str]:
  """Sets in `environ` (os.environ, before JAX starts) the XLA_FLAGS and the allocator's
  memory fraction `platform` gets where the user set neither; returns what it set as
  'NAME=value' lines."""
  chosen = {"XLA_FLAGS": default_xla_flags(environ, platform, host_device_count),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": default_memory_fraction(environ, platform)}
  lines = []
  for name, value in chosen.items():
    if value is not None:
      environ[name] = value
      lines.append(f"{name}={value}")
  return lines
