"""The one place that decides how this package's Pallas kernels are lowered.

Backends (a kernel's tuning dataclass names one; resolved when the program is built):

* ``"auto"``: ``"interpret"`` on CPU, ``"triton"`` on GPU (no TPU backend here); for the
  grouped matmul (`resolve_gmm`), ``"mosaic_gpu"`` on a Hopper GPU (compute capability 9.x,
  read from the device: H100, H200, H800, H20) when its operands are bf16/f16.
* ``"interpret"``: ``pallas_call(interpret=True)``, runs anywhere (CPU tests and CI).
* ``"triton"``: the Pallas Triton lowering, chosen by passing Triton ``CompilerParams``
  (a GPU ``pallas_call`` without them lowers to Mosaic GPU). The kernels of
  this package are written for it: row gathers by a vector of indices, masked loads and
  stores, ``tl.dot`` tiles. Deprecated by JAX, still present in the releases compat.py
  supports.
* ``"mosaic_gpu"``: Hopper (sm_90). Only the grouped matmul has this path: its forward and
  dx on JAX's own Mosaic GPU ragged-dot kernel (``jax.experimental.pallas.ops.gpu``) or this
  package's (gmm_hopper.py), its dw on Triton or gmm_hopper's; the row gathers keep the
  Triton lowering (see gmm_mosaic.py).
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import compat

BACKENDS = ("auto", "interpret", "triton", "mosaic_gpu")
GPU_BACKENDS = ("triton", "mosaic_gpu")
MIN_DOT_TILE = 16     # tl.dot needs every tile dim >= 16


def resolve(backend: str, platform: str | None = None) -> str:
  """'auto' -> a concrete backend for `platform` (default: JAX's default backend). The MoE
  layer passes its mesh's platform."""
  if backend not in BACKENDS:
    raise ValueError(f"Pallas backend {backend!r} is unknown; use one of {BACKENDS}.")
  platform = platform or jax.default_backend()
  if backend != "auto":
    return backend
  if platform == "cpu":
    return "interpret"
  if platform in ("gpu", "cuda", "rocm"):
    return "triton"
  raise ValueError(f"these Pallas kernels have no {platform} backend; use moe.kernels = 'xla' "
                   "(or backend='interpret').")


def is_hopper(capability: str | None) -> bool:
  return capability is not None and capability.split(".")[0] == "9"


def resolve_gmm(backend: str, platform: str | None = None, capability: str | None = None,
                dtype=None) -> str:
  """The grouped matmul's backend: as `resolve`, except that 'auto' on a Hopper GPU with
  bf16/f16 operands is 'mosaic_gpu'. `capability` defaults to the default device's."""
  resolved = resolve(backend, platform)
  if backend != "auto" or resolved != "triton":
    return resolved
  if capability is None and platform is None:
    capability = compat.compute_capability(jax.devices()[0])
  mosaic_dtype = dtype is not None and jax.numpy.dtype(dtype).name in ("bfloat16", "float16")
  return "mosaic_gpu" if is_hopper(capability) and mosaic_dtype else "triton"


def call_kwargs(backend: str, num_warps: int | None = None,
                num_stages: int | None = None) -> dict:
  """Keyword arguments of `pl.pallas_call` for a resolved gather/matmul backend."""
  if backend == "interpret":
    return {"interpret": True}
  if backend in GPU_BACKENDS:      # mosaic_gpu: the generic kernels stay on Triton
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)}
  raise ValueError(f"backend {backend!r} is not resolved; call resolve() first.")


out_struct = compat.out_struct


def match_varying(*xs):
  """Inside shard_map, cast the arrays to vary over the union of their mesh axes, so a
  custom_vjp's cotangents have its inputs' types (the cast's transpose sums the cotangent of
  a replicated input, e.g. expert weights, over the axes it was broadcast to)."""
  union = frozenset().union(*(compat.varying_axes(x) for x in xs))
  return [compat.mark_varying(x, union) for x in xs]


def pow2_tile(dim: int, want: int) -> int:
  """The largest power of two <= `want` that divides `dim` (1 for odd dims)."""
  tile = 1
  while tile * 2 <= want and dim % (tile * 2) == 0:
    tile *= 2
  return tile


def check_pow2(name: str, value: int) -> None:
  if value < 1 or value & (value - 1):
    raise ValueError(f"{name}={value} must be a power of two (Triton tiles); e.g. 64.")


def check_dot_tile(name: str, dim: int, tile: int, backend: str) -> None:
  """Triton's tl.dot needs tiles >= 16: one line naming the dim when it cannot get one."""
  if backend != "interpret" and tile < MIN_DOT_TILE:
    raise ValueError(f"{name}={dim} has no power-of-two tile >= {MIN_DOT_TILE} for the Triton "
                     f"matmul; pad {name} to a multiple of {MIN_DOT_TILE} or use "
                     "backend='interpret'.")


def check_row_tile(name: str, block_m: int, backend: str) -> None:
  """The matmul's row tile is a tl.dot dim too (interpret mode takes any power of two)."""
  check_pow2(name, block_m)
  if backend != "interpret" and block_m < MIN_DOT_TILE:
    raise ValueError(f"{name}={block_m} is below {MIN_DOT_TILE}, the smallest Triton matmul "
                     f"tile; use {name}={MIN_DOT_TILE} or more (64 on a GPU), or "
                     "backend='interpret'.")
