"""The one place that decides how this package's Pallas kernels are lowered.

Backends (a kernel's tuning dataclass names one; resolved when the program is built):

* ``"auto"``: ``"interpret"`` on CPU, ``"triton"`` on GPU (no TPU backend here).
* ``"interpret"``: ``pallas_call(interpret=True)``, runs anywhere (CPU tests and CI).
* ``"triton"``: the Pallas Triton lowering, chosen by passing Triton ``CompilerParams``
  (since jax 0.10 a GPU ``pallas_call`` without them lowers to Mosaic GPU). The kernels of
  this package are written for it: row gathers by a vector of indices, masked loads and
  stores, ``tl.dot`` tiles. Deprecated in jax 0.11 but still present there.
* ``"mosaic_gpu"``: Hopper (sm_90). Only the grouped matmul has this path: it delegates to
  JAX's own Mosaic GPU ragged-dot kernels (``jax.experimental.pallas.ops.gpu``); the row
  gathers keep the Triton lowering.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pltriton

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


def call_kwargs(backend: str, num_warps: int | None = None,
                num_stages: int | None = None) -> dict:
  """Keyword arguments of `pl.pallas_call` for a resolved gather/matmul backend."""
  if backend == "interpret":
    return {"interpret": True}
  if backend in GPU_BACKENDS:      # mosaic_gpu: the generic kernels stay on Triton
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)}
  raise ValueError(f"backend {backend!r} is not resolved; call resolve() first.")


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A pallas_call output type. Inside `jax.shard_map` (check_vma) it must name the mesh axes
  it varies over: the union of its inputs'. jax 0.10 calls that `manual_axis_type`, earlier
  releases `vma`; outside shard_map both are empty and ignored."""
  avals = [jax.typeof(x) for x in inputs]
  mats = [a.mat for a in avals if getattr(a, "mat", None) is not None]
  if mats:
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(mats[0])(varying=varying))
  vmas = [a.vma for a in avals if getattr(a, "vma", None) is not None]
  if vmas:
    return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset().union(*vmas))
  return jax.ShapeDtypeStruct(shape, dtype)


def _varying(x) -> frozenset:
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def match_varying(*xs):
  """Inside shard_map, cast the arrays to vary over the union of their mesh axes, so a
  custom_vjp's cotangents have its inputs' types (the cast's transpose sums the cotangent of
  a replicated input, e.g. expert weights, over the axes it was broadcast to)."""
  sets = [_varying(x) for x in xs]
  union = frozenset().union(*sets)
  out = []
  for x, v in zip(xs, sets):
    missing = tuple(sorted(union - v))
    if missing:
      x = (jax.lax.pcast(x, missing, to="varying") if hasattr(jax.lax, "pcast")
           else jax.lax.pvary(x, missing))
    out.append(x)
  return out


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
