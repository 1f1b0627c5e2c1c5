"""Hopper (sm_90) path of the grouped matmul: JAX's own Mosaic GPU ragged-dot kernels.

`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (forward and, with
`transpose_rhs`, dx) and `transposed_ragged_dot_mgpu.transposed_ragged_dot` (dw) ship with
jax 0.10 and 0.11. They take bf16/f16 operands of one dtype and tile sizes that divide the
feature dims; rows past the last group are not written there, so they are zeroed here.
On a CPU machine this path can be lowered for CUDA (`jax.export`), not run.
"""

from __future__ import annotations

import jax.numpy as jnp

MOSAIC_DTYPES = ("bfloat16", "float16")


def _check(x, w_or_dy, tuning, dims):
  if x.dtype != w_or_dy.dtype or jnp.dtype(x.dtype).name not in MOSAIC_DTYPES:
    raise ValueError(f"gmm backend 'mosaic_gpu' needs bf16/f16 operands of one dtype, got "
                     f"{x.dtype} and {w_or_dy.dtype}; cast them or use backend='triton'.")
  for name, dim, tile in dims:
    if dim % tile:
      raise ValueError(f"gmm backend 'mosaic_gpu': {name}={dim} is not a multiple of "
                       f"{tile}; pad it or use backend='triton'.")


def ragged_dot(x_MxI, w_GxIxO, group_sizes_G, tuning, transpose_rhs=False):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  n = w_GxIxO.shape[1] if transpose_rhs else w_GxIxO.shape[2]
  _check(x_MxI, w_GxIxO, tuning, [("I", x_MxI.shape[1], tuning.block_k),
                                  ("O", n, tuning.block_n * tuning.grid_block_n)])
  out = ragged_dot_mgpu.ragged_dot(
      x_MxI, w_GxIxO, group_sizes=group_sizes_G.astype(jnp.int32), block_m=tuning.block_m,
      block_n=tuning.block_n, block_k=tuning.block_k,
      max_concurrent_steps=tuning.max_concurrent_steps, grid_block_n=tuning.grid_block_n,
      transpose_rhs=transpose_rhs)
  total = jnp.minimum(jnp.sum(jnp.maximum(group_sizes_G, 0)), x_MxI.shape[0])
  return jnp.where(jnp.arange(x_MxI.shape[0])[:, None] < total, out, jnp.zeros((), out.dtype))


def transposed_ragged_dot(x_MxI, dy_MxO, group_sizes_G, tuning):
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
  _check(x_MxI, dy_MxO, tuning, [("I", x_MxI.shape[1], tuning.block_m),
                                 ("O", dy_MxO.shape[1], tuning.block_n * tuning.grid_block_n)])
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(
      x_MxI, dy_MxO, group_sizes=group_sizes_G.astype(jnp.int32), block_m=tuning.block_m,
      block_n=tuning.block_n, block_k=tuning.block_k,
      max_concurrent_steps=tuning.max_concurrent_steps, grid_block_n=tuning.grid_block_n)
