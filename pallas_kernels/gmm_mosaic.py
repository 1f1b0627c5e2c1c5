"""Hopper (sm_90) path of the grouped matmul: which Mosaic GPU kernel runs, and the glue.

`GmmTuning.mosaic_kernel` picks the forward's and dx's kernel:
* 'jax': JAX's ragged dot (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, shipped with
  the jax releases compat.py supports). Rows past the last group are not written there, so
  they are zeroed here; its row count is padded to a multiple of 8, which its TMA tiles need
  (`ROW_ALIGN`). Its persistent grid is fixed at 132 programs: on a GPU with fewer SMs
  (H100 PCIe: 114, H20: 78) the extra programs wait for a free SM, same result.
* 'hopper': this package's warp-specialised kernel (gmm_hopper.gmm), which zeroes those rows
  itself and takes the SM count from `GmmTuning.num_sms`.
`GmmTuning.mosaic_dw` runs dw on gmm_hopper.tgmm too (else on the Triton `tgmm`, see
grouped_matmul.py; JAX's own `transposed_ragged_dot` reads `jax.devices()[0].core_count` when
traced, so it cannot be lowered on a host without a GPU). Both take bf16/f16 operands of one
dtype and tiles that divide the feature dims. Outputs name no mesh axes, so inside
`shard_map` they are cast to vary like their operands. Under `vmap` (the pipeline's stages)
each kernel runs once per batch element.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import compat, gmm_hopper

MOSAIC_DTYPES = ("bfloat16", "float16")
WGMMA_ROWS = 64     # a Hopper wgmma's accumulator rows: the kernel's row tile is a multiple
ROW_ALIGN = 8       # its TMA tiles read rows in 8s: M is padded to a multiple (seen on an H100)


def hopper_tuning(tuning):
  """The tiles JAX's ragged dot ran fastest with on one H100 (bf16, the MoE
  layer's [131072, 1024] x [4, 1024, 2048] and [16384, 768] x [32, 768, 1536]): 128 x 128 x 64,
  4 steps in flight, 4 column tiles per program; 1.56 ms against 3.7 ms for 64 x 64 x 64 with
  1 (`benchmarks/results/gmm_mosaic_sweep_h100.json`). Triton's dw keeps 8 warps, 3 stages."""
  return dataclasses.replace(tuning, block_m=128, block_k=64, block_n=128, num_warps=8,
                             num_stages=3, max_concurrent_steps=4, grid_block_n=4)


def fitted(tuning, n: int):
  """`tuning` with fewer column tiles per program (grid_block_n halved) until they divide the
  output's `n` columns: the schedule changes, not the result."""
  grid = tuning.grid_block_n
  while grid > 1 and n % (tuning.block_n * grid):
    grid //= 2
  return dataclasses.replace(tuning, grid_block_n=grid)


def unsupported(x_rowsxin, w_Cxinxout, tuning, transpose_rhs=False) -> str | None:
  """Why these operands cannot take the Mosaic path (None: they can)."""
  if x_rowsxin.dtype != w_Cxinxout.dtype or jnp.dtype(x_rowsxin.dtype).name not in MOSAIC_DTYPES:
    return (f"gmm backend 'mosaic_gpu' needs bf16/f16 operands of one dtype, got {x_rowsxin.dtype} "
            f"and {w_Cxinxout.dtype}; cast them or use backend='triton'.")
  if tuning.block_m % WGMMA_ROWS:
    return (f"gmm backend 'mosaic_gpu': GmmTuning.block_m={tuning.block_m} is not a multiple of "
            f"{WGMMA_ROWS} (a Hopper wgmma's rows); use block_m={WGMMA_ROWS} or backend='triton'.")
  n = w_Cxinxout.shape[1] if transpose_rhs else w_Cxinxout.shape[2]
  for name, dim, tile in [("I", x_rowsxin.shape[1], tuning.block_k),
                          ("O", n, tuning.block_n * tuning.grid_block_n)]:
    if dim % tile:
      return (f"gmm backend 'mosaic_gpu': {name}={dim} is not a multiple of {tile}; pad it or "
              "use backend='triton'.")
  return None


def _varying_like(out, *operands):
  axes = frozenset().union(*(compat.varying_axes(a) for a in operands))
  return compat.mark_varying(out, axes)


def hopper_fitted(tuning, n: int):
  """`tuning` for gmm_hopper.gmm with narrower column tiles (block_n halved down to 64, then
  split 'm', one column tile per CTA) until they divide the output's `n` columns."""
  block_n, split = tuning.block_n, tuning.split
  while split == "n" and n % (2 * block_n) and block_n > 64:
    block_n //= 2
  if split == "n" and n % (2 * block_n):
    split = "m"
  return dataclasses.replace(tuning, block_n=block_n, split=split)


def _hopper_gmm(x_rowsxin, w_Cxinxout, group_sizes_C, tuning, transpose_rhs):
  tuning = hopper_fitted(tuning, w_Cxinxout.shape[1] if transpose_rhs else w_Cxinxout.shape[2])
  if why := gmm_hopper.gmm_unsupported(x_rowsxin, w_Cxinxout, tuning.block_m, tuning.block_n,
                                       tuning.block_k, tuning.split, transpose_rhs):
    raise ValueError(f"gmm backend 'mosaic_gpu': {why}")

  @jax.custom_batching.sequential_vmap
  def kernel(x_rowsxin, w_Cxinxout, group_sizes_C):
    return gmm_hopper.gmm(x_rowsxin, w_Cxinxout, group_sizes_C, block_m=tuning.block_m,
                          block_n=tuning.block_n, block_k=tuning.block_k,
                          max_concurrent_steps=tuning.max_concurrent_steps, split=tuning.split,
                          transpose_rhs=transpose_rhs, num_sms=tuning.num_sms)

  out = kernel(x_rowsxin, w_Cxinxout, group_sizes_C.astype(jnp.int32))
  return _varying_like(out, x_rowsxin, w_Cxinxout, group_sizes_C)


def tgmm(x_rowsxin, dy_rowsxout, group_sizes_C, tuning, out_dtype):
  """dw on gmm_hopper.tgmm: [C, in, out] in `out_dtype`."""
  if why := gmm_hopper.tgmm_unsupported(x_rowsxin, dy_rowsxout, tuning.block_m, tuning.block_n,
                                        tuning.block_k):
    raise ValueError(f"gmm backend 'mosaic_gpu' (mosaic_dw): {why}")

  @jax.custom_batching.sequential_vmap
  def kernel(x_rowsxin, dy_rowsxout, group_sizes_C):
    return gmm_hopper.tgmm(x_rowsxin, dy_rowsxout, group_sizes_C, block_m=tuning.block_m,
                           block_n=tuning.block_n, block_k=tuning.block_k,
                           max_concurrent_steps=tuning.max_concurrent_steps,
                           out_dtype=out_dtype, num_sms=tuning.num_sms)

  out = kernel(x_rowsxin, dy_rowsxout, group_sizes_C.astype(jnp.int32))
  return _varying_like(out, x_rowsxin, dy_rowsxout, group_sizes_C)


def ragged_dot(x_rowsxin, w_Cxinxout, group_sizes_C, tuning, transpose_rhs=False):
  """The forward (or dx, with w read transposed) on the kernel `tuning.mosaic_kernel` names."""
  if tuning.mosaic_kernel == "hopper":
    return _hopper_gmm(x_rowsxin, w_Cxinxout, group_sizes_C, tuning, transpose_rhs)
  if tuning.mosaic_kernel != "jax":
    raise ValueError(f"GmmTuning.mosaic_kernel={tuning.mosaic_kernel!r} is unknown; use 'jax' "
                     "or 'hopper'.")
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  tuning = fitted(tuning, w_Cxinxout.shape[1] if transpose_rhs else w_Cxinxout.shape[2])
  if why := unsupported(x_rowsxin, w_Cxinxout, tuning, transpose_rhs):
    raise ValueError(why)
  m = x_rowsxin.shape[0]
  padded_rowsxin = jnp.pad(x_rowsxin, ((0, -m % ROW_ALIGN), (0, 0)))   # padding: past every group
  # Under vmap (the pipeline's stage vmap, even of one stage) one call per batch element:
  # Pallas's batching of this kernel hands it group sizes as a sliced ref, which it cannot
  # take ("object of type 'TransformedRef' has no len()").
  @jax.custom_batching.sequential_vmap
  def kernel(x_rowsxin, w_Cxinxout, group_sizes_C):
    return ragged_dot_mgpu.ragged_dot(
        x_rowsxin, w_Cxinxout, group_sizes=group_sizes_C, block_m=tuning.block_m,
        block_n=tuning.block_n, block_k=tuning.block_k,
        max_concurrent_steps=tuning.max_concurrent_steps, grid_block_n=tuning.grid_block_n,
        transpose_rhs=transpose_rhs)

  out = kernel(padded_rowsxin, w_Cxinxout, group_sizes_C.astype(jnp.int32))
  out = _varying_like(out[:m], x_rowsxin, w_Cxinxout, group_sizes_C)
  total = jnp.minimum(jnp.sum(jnp.maximum(group_sizes_C, 0)), m)
  return jnp.where(jnp.arange(m)[:, None] < total, out, jnp.zeros((), out.dtype))
