"""Hopper (sm_90) path of the grouped matmul's forward and dx: JAX's Mosaic GPU ragged dot.

`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` ships with jax 0.10 and 0.11. It
takes bf16/f16 operands of one dtype and tile sizes that divide the feature dims; rows past
the last group are not written there, so they are zeroed here. Its output type names no mesh
axes, so inside `shard_map` it is cast to vary like its operands.

The weight gradient (dw) is not computed here: JAX's `transposed_ragged_dot` reads
`jax.devices()[0].core_count` when traced, so it cannot be lowered on a host without a GPU and
sizes its grid from device 0 rather than the target; dw runs on this package's Triton `tgmm`
(see grouped_matmul.py). The forward's persistent grid is fixed at 132 programs inside JAX's
kernel: on a GPU with fewer SMs (H100 PCIe: 114, H20: 78) the extra programs wait for a free
SM, so the result is the same and only the schedule differs.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import compat

MOSAIC_DTYPES = ("bfloat16", "float16")


def unsupported(x_MxI, w_GxIxO, tuning, transpose_rhs=False) -> str | None:
  """Why these operands cannot take the Mosaic path (None: they can)."""
  if x_MxI.dtype != w_GxIxO.dtype or jnp.dtype(x_MxI.dtype).name not in MOSAIC_DTYPES:
    return (f"gmm backend 'mosaic_gpu' needs bf16/f16 operands of one dtype, got {x_MxI.dtype} "
            f"and {w_GxIxO.dtype}; cast them or use backend='triton'.")
  n = w_GxIxO.shape[1] if transpose_rhs else w_GxIxO.shape[2]
  for name, dim, tile in [("I", x_MxI.shape[1], tuning.block_k),
                          ("O", n, tuning.block_n * tuning.grid_block_n)]:
    if dim % tile:
      return (f"gmm backend 'mosaic_gpu': {name}={dim} is not a multiple of {tile}; pad it or "
              "use backend='triton'.")
  return None


def ragged_dot(x_MxI, w_GxIxO, group_sizes_G, tuning, transpose_rhs=False):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  if why := unsupported(x_MxI, w_GxIxO, tuning, transpose_rhs):
    raise ValueError(why)
  out = ragged_dot_mgpu.ragged_dot(
      x_MxI, w_GxIxO, group_sizes=group_sizes_G.astype(jnp.int32), block_m=tuning.block_m,
      block_n=tuning.block_n, block_k=tuning.block_k,
      max_concurrent_steps=tuning.max_concurrent_steps, grid_block_n=tuning.grid_block_n,
      transpose_rhs=transpose_rhs)
  axes = frozenset().union(*(compat.varying_axes(a) for a in (x_MxI, w_GxIxO, group_sizes_G)))
  out = compat.mark_varying(out, axes)
  total = jnp.minimum(jnp.sum(jnp.maximum(group_sizes_G, 0)), x_MxI.shape[0])
  return jnp.where(jnp.arange(x_MxI.shape[0])[:, None] < total, out, jnp.zeros((), out.dtype))
