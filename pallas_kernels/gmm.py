"""Grouped matmul for expert FFNs, with group sizes as data.

    gmm:   out[m] = x[m] @ w[g(m)]                 x [rows, in], w [C, in, out] -> [rows, out]
    tgmm:  dw[g]  = x[rows of g]^T @ dy[rows of g]  x [rows, in], dy [rows, out] -> [C, in, out]

C groups, one per slot of the device (moejax.SHAPE_LETTERS); rows, in and out are words.
Group g owns the contiguous rows [sum(sizes[:g]), sum(sizes[:g+1])); rows past the last group
give zeros (and get zero gradient), so a buffer may carry padding at its end; empty groups
cost nothing. `gmm` walks a static-length work list of (row tile, group) pairs, at most
cdiv(rows, bm) + C long (a group boundary inside a tile adds one pair), each program masking
the tile to its group's rows, so a tile shared by two groups is written by two programs,
disjointly; `tgmm` runs one program per (group, in tile, out tile) and loops over the group's
row tiles. Backward of gmm: dx = gmm(dy, w^T) (w read transposed), dw = tgmm(x, dy).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend as backend_lib


@dataclasses.dataclass(frozen=True)
class GmmTuning:
  """Tiles of the grouped matmul (forward, dx, and dw's tgmm). block_m, and the K and N tiles
  found from block_k / block_n, are tl.dot dims: >= 16 on Triton (checked), any power of two
  when interpreted.

  sm_90a, bf16, configs/gpt_moe_gpu.gin's up-projection forward ([32768, 768] x [4, 768, 1536]),
  registers / spill bytes per thread from `python -m benchmarks.kernels.gpu_compile --sweep`:

    block_m x block_k x block_n   warps   stages   regs / spill
    64 x 64 x 64                  4       2         93 / 0        the default (fwd, dx, dw:
                                                                  93, 80, 75 registers)
    64 x 64 x 128                 8       2         79 / 0
    128 x 64 x 64                 8       2         91 / 0
    128 x 32 x 128                4       2        255 / 456      spills
    128 x 32 x 128                8       2        163 / 0
  mosaic_gpu takes block_m/k/n as JAX's ragged_dot tiles (block_m a multiple of 64; I and O
  multiples of block_k and block_n * grid_block_n), or with mosaic_kernel='hopper' as each
  consumer warpgroup's tile of gmm_hopper.gmm (and with mosaic_dw, gmm_hopper.tgmm's); the
  MoE layer gives it gmm_mosaic.hopper_tuning, the fastest of a sweep on one H100. Triton's
  tiles were timed on that H100 too (`benchmarks/kernels/results/gmm_tiles_h100.json`); the default
  stays 64 x 64 x 64.
  """
  block_m: int = 64         # rows per tile (power of two)
  block_k: int = 64         # contraction tile: largest power of two <= this dividing the dim
  block_n: int = 64         # output-column tile: likewise
  num_warps: int = 4
  num_stages: int = 2
  backend: str = "auto"     # see pallas_kernels.backend
  # mosaic_gpu only (Hopper; see gmm_mosaic.py):
  max_concurrent_steps: int = 4
  grid_block_n: int = 1     # 'jax' only: column tiles per program
  mosaic_kernel: str = "jax"   # fwd and dx: 'jax' (JAX's ragged dot) or 'hopper' (gmm_hopper)
  split: str = "n"          # 'hopper': the CTA's two warpgroups split the tile's cols or rows
  mosaic_dw: bool = False   # dw on gmm_hopper.tgmm rather than Triton's tgmm
  num_sms: int = 132        # 'hopper' and mosaic_dw: the persistent grid (the GPU's SMs)


def gmm_reference(x_rowsxin, w_Cxinxout, group_sizes_C):
  """Dense per-row weight gather: memory O(M*I*O); for tests."""
  m, num_groups = x_rowsxin.shape[0], w_Cxinxout.shape[0]
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_C, 0)), m)
  group_rows = jnp.searchsorted(ends, jnp.arange(m), side="right")
  ok = group_rows < num_groups
  w_rowsxinxout = w_Cxinxout[jnp.minimum(group_rows, num_groups - 1)]
  out = jnp.einsum("mi,mio->mo", x_rowsxin.astype(jnp.float32), w_rowsxinxout.astype(jnp.float32))
  return jnp.where(ok[:, None], out, 0.0).astype(x_rowsxin.dtype)


def tgmm_reference(x_rowsxin, dy_rowsxout, group_sizes_C, out_dtype=None):
  m, num_groups = x_rowsxin.shape[0], group_sizes_C.shape[0]
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_C, 0)), m)
  onehot_rowsxC = jax.nn.one_hot(jnp.searchsorted(ends, jnp.arange(m), side="right"), num_groups)
  out = jnp.einsum("mg,mi,mo->gio", onehot_rowsxC, x_rowsxin.astype(jnp.float32),
                   dy_rowsxout.astype(jnp.float32))
  return out.astype(out_dtype or x_rowsxin.dtype)


def group_bounds(group_sizes_C, m):
  """int32 starts/ends of the C groups plus the tail group C = [end of last group, rows)."""
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_C.astype(jnp.int32), 0)), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  return starts, jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])


def work_list(starts_C, ends_C, m, block_m):
  """(row tile, group, valid) for each of cdiv(M, bm) + G programs; groups include the tail."""
  num_pairs = pl.cdiv(m, block_m) + starts_C.shape[0] - 1
  first = starts_C // block_m
  tiles = jnp.where(ends_C > starts_C, (ends_C - 1) // block_m - first + 1, 0)
  cum = jnp.cumsum(tiles)
  p = jnp.arange(num_pairs, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(cum, p, side="right"), starts_C.shape[0] - 1)
  tile = first[group] + p - (cum - tiles)[group]
  return tile.astype(jnp.int32), group.astype(jnp.int32), (p < cum[-1]).astype(jnp.int32)


def _gmm_kernel(starts_ref, ends_ref, tile_ref, group_ref, valid_ref, x_ref, w_ref, out_ref, *,
                num_groups, block_m, block_k, block_n, k_blocks, transpose_rhs):
  p, j = pl.program_id(0), pl.program_id(1)
  tile, g = tile_ref[p], group_ref[p]
  rows = pl.ds(tile * block_m, block_m)
  cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
  r = tile * block_m + jnp.arange(block_m)
  mask = ((r >= starts_ref[g]) & (r < ends_ref[g]))[:, None]
  work = valid_ref[p] > 0

  @pl.when(work & (g < num_groups))
  def _():
    def body(kb, acc):
      ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
      a = pltriton.load(x_ref.at[rows, ks], mask=mask, other=0)
      if transpose_rhs:     # w [C, out, contraction]
        b, dims = w_ref[g, cols, ks], (((1,), (1,)), ((), ()))
      else:                 # w [C, contraction, out]
        b, dims = w_ref[g, ks, cols], (((1,), (0,)), ((), ()))
      return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=mask)

  @pl.when(work & (g == num_groups))
  def _():
    pltriton.store(out_ref.at[rows, cols], jnp.zeros((block_m, block_n), out_ref.dtype),
                   mask=mask)


def gmm_call(x_rowsxin, w_Cxinxout, group_sizes_C, tuning: GmmTuning, backend: str,
             transpose_rhs: bool = False):
  """Generic Pallas grouped matmul (no custom_vjp); `backend` resolved, not mosaic_gpu."""
  m, k = x_rowsxin.shape
  num_groups = w_Cxinxout.shape[0]
  n = w_Cxinxout.shape[1] if transpose_rhs else w_Cxinxout.shape[2]
  if m == 0 or n == 0 or k == 0 or num_groups == 0:
    return jnp.zeros((m, n), x_rowsxin.dtype)
  bk, bn = backend_lib.pow2_tile(k, tuning.block_k), backend_lib.pow2_tile(n, tuning.block_n)
  backend_lib.check_dot_tile("contraction dim", k, bk, backend)
  backend_lib.check_dot_tile("output dim", n, bn, backend)
  starts, ends = group_bounds(group_sizes_C, m)
  tile, group, valid = work_list(starts, ends, m, tuning.block_m)
  kernel = functools.partial(_gmm_kernel, num_groups=num_groups, block_m=tuning.block_m,
                             block_k=bk, block_n=bn, k_blocks=k // bk,
                             transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      out_shape=backend_lib.out_struct((m, n), x_rowsxin.dtype, x_rowsxin, w_Cxinxout,
                                       group_sizes_C),
      grid=(tile.shape[0], n // bn), name="gmm",
      **backend_lib.call_kwargs(backend, tuning.num_warps, tuning.num_stages))(
          starts, ends, tile, group, valid, x_rowsxin, w_Cxinxout)


def _tgmm_kernel(starts_ref, ends_ref, x_ref, dy_ref, out_ref, *, block_m, block_k, block_n):
  g, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = starts_ref[g], ends_ref[g]
  ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
  ns = pl.ds(pl.multiple_of(nb * block_n, block_n), block_n)
  first = start // block_m
  num_tiles = jnp.where(end > start, (end - 1) // block_m - first + 1, 0)

  def body(t, acc):
    r = t * block_m + jnp.arange(block_m)
    mask = ((r >= start) & (r < end))[:, None]
    a = pltriton.load(x_ref.at[pl.ds(t * block_m, block_m), ks], mask=mask, other=0)
    b = pltriton.load(dy_ref.at[pl.ds(t * block_m, block_m), ns], mask=mask, other=0)
    return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(first, first + num_tiles, body,
                          jnp.zeros((block_k, block_n), jnp.float32))
  out_ref[g, ks, ns] = acc.astype(out_ref.dtype)


def tgmm_call(x_rowsxin, dy_rowsxout, group_sizes_C, tuning: GmmTuning, backend: str, out_dtype):
  """Generic Pallas transposed grouped matmul: [C, in, out] in `out_dtype`."""
  (m, k), n, num_groups = x_rowsxin.shape, dy_rowsxout.shape[1], group_sizes_C.shape[0]
  if m == 0 or n == 0 or k == 0 or num_groups == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)
  bk, bn = backend_lib.pow2_tile(k, tuning.block_k), backend_lib.pow2_tile(n, tuning.block_n)
  backend_lib.check_dot_tile("x columns", k, bk, backend)
  backend_lib.check_dot_tile("dy columns", n, bn, backend)
  starts, ends = group_bounds(group_sizes_C, m)
  kernel = functools.partial(_tgmm_kernel, block_m=tuning.block_m, block_k=bk, block_n=bn)
  return pl.pallas_call(
      kernel, out_shape=backend_lib.out_struct((num_groups, k, n), out_dtype, x_rowsxin,
                                               dy_rowsxout,
                                               group_sizes_C),
      grid=(num_groups, k // bk, n // bn), name="tgmm",
      **backend_lib.call_kwargs(backend, tuning.num_warps, tuning.num_stages))(
          starts, ends, x_rowsxin, dy_rowsxout)
