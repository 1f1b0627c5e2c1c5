"""Everything that differs between the JAX releases this package supports (0.10 to 0.12), and
what it needs to know about NVIDIA GPUs it has not been handed.

* Lowering the Pallas Triton kernels for CUDA on a host without a GPU (`cuda_target`): jax
  0.10 falls back to compute capability 9.0; jax 0.11 asks its GPU table for the device it
  lowers for and raises "No supported GPU devices found" when that device is a CPU. The
  context manager names the target GPU for that table, through the one hook jax 0.11 offers
  for device kinds it does not know (`gpu_info.registry`), and removes it on exit.
* Hopper detection by compute capability (`compute_capability`), with device kinds jax's own
  table lacks (H800, H20, L40S) known here too, so a name is enough on a CPU host.
* The varying-axes type of an output inside `shard_map` (`varying_axes`, `out_struct`,
  `mark_varying`): jax >= 0.10 calls it `manual_axis_type`, earlier releases `vma`.
* Mosaic GPU's interpreter on CPU (`mosaic_gpu_interpret`): jax >= 0.11 runs this package's
  Hopper kernels in it; jax 0.10's cannot read an SMEM tile transposed (a wgmma operand).
* What these releases cannot check or batch in the MoE layer (`checks_varying_axes`,
  `rerestores_fsep`): the layer and the pipeline ask here rather than name a release.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax

JAX_VERSION = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:2])


@dataclasses.dataclass(frozen=True)
class Gpu:
  kind: str               # jax's device_kind
  capability: str         # compute capability, "9.0"
  num_sms: int            # streaming multiprocessors (Mosaic GPU's persistent grid)
  table_kind: str         # a kind of the same architecture that jax 0.11's GPU table knows


# Longer names first: "NVIDIA H100 PCIe" before "NVIDIA H100", "L40S" before "L40".
KNOWN_GPUS = (
    Gpu("NVIDIA H100 PCIe", "9.0", 114, "NVIDIA H100"),
    Gpu("NVIDIA H100 80GB HBM3", "9.0", 132, "NVIDIA H100"),
    Gpu("NVIDIA H100", "9.0", 132, "NVIDIA H100"),
    Gpu("NVIDIA H200", "9.0", 132, "NVIDIA H200"),
    Gpu("NVIDIA GH200", "9.0", 132, "NVIDIA GH200"),
    Gpu("NVIDIA H800", "9.0", 132, "NVIDIA H100"),
    Gpu("NVIDIA H20", "9.0", 78, "NVIDIA H100"),
    Gpu("NVIDIA L40S", "8.9", 142, "NVIDIA L40"),
    Gpu("NVIDIA L40", "8.9", 142, "NVIDIA L40"),
    Gpu("NVIDIA L4", "8.9", 58, "NVIDIA L4"),
    Gpu("NVIDIA A100", "8.0", 108, "NVIDIA A100"),
    Gpu("NVIDIA A10", "8.6", 72, "NVIDIA A10"),
)
DEFAULT_TARGET = "NVIDIA H100"


def known_gpu(device_kind: str) -> Gpu | None:
  for gpu in KNOWN_GPUS:
    if device_kind.startswith(gpu.kind):
      return gpu
  return None


def is_nvidia_gpu(platform: str | None) -> bool:
  """Whether a device's `platform` is an NVIDIA GPU's: 'gpu' (compile-only topologies and
  jax's name) or 'cuda' (the plugin's)."""
  return platform in ("gpu", "cuda")


def compute_capability(device) -> str | None:
  """"9.0" for a GPU device (its own attribute), else None (CPU)."""
  if not is_nvidia_gpu(getattr(device, "platform", None)):
    return None
  cc = getattr(device, "compute_capability", None)
  if cc:
    return str(cc)
  gpu = known_gpu(getattr(device, "device_kind", ""))
  return gpu.capability if gpu else None


def num_sms(device) -> int | None:
  """The device's SM count, read only from a GPU device (None on a CPU host)."""
  if compute_capability(device) is None:
    return None
  return getattr(device, "core_count", None) or getattr(known_gpu(device.device_kind),
                                                        "num_sms", None)


@contextlib.contextmanager
def cuda_target(device_kind: str = DEFAULT_TARGET):
  """Within it, the Pallas Triton lowering on a host without a GPU targets `device_kind`
  (no effect where a GPU is the device being lowered for). jax 0.10 has no hook: it always
  assumes 9.0 there, so any other target is refused rather than silently ignored."""
  gpu = known_gpu(device_kind)
  if gpu is None:
    raise ValueError(f"GPU {device_kind!r} is unknown here; use one of "
                     f"{[g.kind for g in KNOWN_GPUS]}.")
  if JAX_VERSION < (0, 11):
    if gpu.capability != "9.0":
      raise ValueError(f"jax {jax.__version__} lowers Pallas Triton kernels without a GPU "
                       f"for compute capability 9.0 only, not {device_kind!r} "
                       f"({gpu.capability}); use jax >= 0.11 or a 9.0 target.")
    yield gpu
    return
  from jax._src.pallas.triton import gpu_info  # jax 0.11's only hook for unknown kinds

  host_kinds = {d.device_kind for d in jax.devices() if compute_capability(d) is None}
  info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion(gpu.table_kind))
  saved = {k: gpu_info.registry[k] for k in host_kinds if k in gpu_info.registry}
  gpu_info.registry.update({k: (lambda info=info: info) for k in host_kinds})
  gpu_info.get_gpu_info.cache_clear()
  try:
    yield gpu
  finally:
    for k in host_kinds:
      gpu_info.registry.pop(k, None)
    gpu_info.registry.update(saved)
    gpu_info.get_gpu_info.cache_clear()


def mosaic_gpu_interpret(detect_races: bool = False):
  """The `interpret` argument that runs a Mosaic GPU kernel on CPU (its threads, barriers and
  TMA copies simulated; with `detect_races`, a happens-before race detector on), or None
  where this jax's interpreter cannot run this package's Hopper kernels."""
  if JAX_VERSION < (0, 11):
    return None
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams(detect_races=detect_races)


def mosaic_gpu_races_found() -> bool:
  """Whether the interpreter's race detector has found a race (jax has no public name)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  return bool(interpret_pallas_call.get_races().races_found)


# --- varying mesh axes inside shard_map --------------------------------------------------------

def varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A pallas_call output type that varies over the union of its inputs' mesh axes (empty
  outside shard_map)."""
  avals = [jax.typeof(x) for x in inputs]
  mats = [a.mat for a in avals if getattr(a, "mat", None) is not None]
  if mats:
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(mats[0])(varying=varying))
  vmas = [a.vma for a in avals if getattr(a, "vma", None) is not None]
  if vmas:
    return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset().union(*vmas))
  return jax.ShapeDtypeStruct(shape, dtype)


def mark_varying(x, axes):
  """`x` cast to vary over `axes` too (a no-op for axes it already varies over)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


# --- what the MoE layer's shard_map can do on these releases -----------------------------------

def checks_varying_axes(interpreted: bool, staged: bool) -> bool:
  """Whether the MoE layer's `shard_map` can run with `check_vma` on. Not with Pallas's
  interpreter: its kernels fail the check inside ("Primitive pad requires varying manual axes
  to match"). Not under the pipeline's stage vmap (`spmd_axis_name`): the batching leaves the
  stage axis out of some values' types (jnp.searchsorted's loop, lax.cond, custom_vjp,
  comparisons; docs/decisions/0046). Values and gradients do not depend on the check: the
  interpreted kernels equal XLA's, and the pipeline equals one device, in the tests."""
  return not interpreted and not staged


def rerestores_fsep(staged: bool) -> bool:
  """Whether fsep's backward pass can restore the experts' weights again (their
  `custom_vjp` calls `jax.vjp` of the MoE layer) rather than keep the forward's: not under
  the pipeline's stage vmap, which cannot batch that vjp's shard_map (docs/decisions/0047)."""
  return not staged
