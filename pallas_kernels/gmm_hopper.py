"""This package's own Hopper (sm_90) grouped matmul, in Mosaic GPU: forward and dx with a
warp-specialised pipeline, dw with the contraction over each group's rows.

    gmm:  out[m] = x[m] @ w[g(m)]         x [rows, in], w [C, in, out] (or [C, out, in])
    tgmm: dw[g] = x[rows of g]^T @ dy[rows of g]                        -> [C, in, out]

What it does that JAX's `ragged_dot_mgpu` kernel (gmm_mosaic.py) does not:
* Two consumer warpgroups and a producer (`emit_pipeline_warp_specialized`), each consumer
  owning a `block_m` x `block_n` accumulator, so a CTA computes a 2 x larger tile (split
  along the output columns, or along the rows with `split='m'`) while TMA loads run on their
  own warpgroup: the structure of JAX's dense Hopper matmul (`hopper_matmul_mgpu`).
* A work list of (row tile, group) pairs built by XLA before the kernel, read once per tile,
  where JAX's kernel rescans every group's bounds for every tile (an unrolled loop over C:
  128 groups are 128 steps of scalar work per tile, and a kernel that grows with C).
* Rows past the last group are written with zeros by the kernel (a tail group), so no
  masking pass over the output follows it, and no copy pads its rows unless they are not a
  multiple of the CTA's rows.
* The grid is the target GPU's SM count (given), not a constant or `jax.devices()[0]`'s, so
  it lowers for a compile-only GPU.

A tile shared by two groups is computed once per group, each storing only its own rows (a
ladder of power-of-two TMA stores from a plain SMEM buffer, as JAX's kernel stores every
tile): up to C - 1 extra tiles. A tile of one group's rows is stored from a swizzled buffer.
Everything the kernel reads is in bounds: x's rows are padded to the CTA's row tile when
they are not a multiple of it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

TILE_DTYPES = ("bfloat16", "float16")
WGMMA_ROWS = 64           # a wgmma's accumulator rows: block_m is a multiple
MEMORY_REGISTERS = 40     # the producer warpgroup's registers (JAX's Hopper matmul's value)


def _plgpu():
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu


def _transposed(ref):
  """A 2-D SMEM ref seen transposed (jax >= 0.11: a method; 0.10: `plgpu.transpose_ref`)."""
  if hasattr(ref, "transpose"):
    return ref.transpose((1, 0))
  return _plgpu().transpose_ref(ref, (1, 0))


def _swizzled(dtype, minor: int):
  plgpu = _plgpu()
  bits = minor * jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(bits)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def work_list(group_sizes_C, m: int, tile_m: int):
  """Per (row tile, group) pair, in row order: the tile, the group (C for the rows past the
  last group) and the rows [lo, hi) of the pair; and how many pairs there are, of the C
  groups and in all (<= the static length cdiv(m, tile_m) + C)."""
  num_groups = group_sizes_C.shape[0]
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_C.astype(jnp.int32), 0)), m)
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])          # + the tail group
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  first = starts // tile_m
  tiles = jnp.where(ends > starts, (ends - 1) // tile_m - first + 1, 0)
  cum = jnp.cumsum(tiles)
  length = pl.cdiv(m, tile_m) + num_groups
  p = jnp.arange(length, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(cum, p, side="right"), num_groups).astype(jnp.int32)
  tile = first[group] + p - (cum - tiles)[group]
  lo = jnp.maximum(starts[group], tile * tile_m)
  hi = jnp.minimum(ends[group], (tile + 1) * tile_m)
  return tile.astype(jnp.int32), group, lo, hi, cum[-2:].astype(jnp.int32)


# A TMA copy's shared-memory address must be 128-byte aligned (a 64-mod-128 one faults with
# CUDA_ERROR_MISALIGNED_ADDRESS on the GPU; Mosaic GPU's interpreter does not check it).
TMA_SMEM_ALIGN = 128


def _ladder(offset, count, rows: int):
  """The row-by-row store's pieces: (size, first row) per set bit of `count` (the rows to
  store, from row `offset`), largest first, a piece of every size a power of two up to `rows`
  (TMA boxes are static; a piece whose bit is clear stores nothing). Works on ints and traced
  values alike."""
  size = 1 << int(math.log2(rows))
  while size >= 1:
    yield size, offset
    offset = offset + (count & size)
    size //= 2


def plain_shift(offset, row_bytes: int):
  """Rows to shift the plain epilogue buffer's tile down by so that every piece of `_ladder`
  from row `offset` starts on a TMA-aligned shared-memory address: rows of 64 bytes (32 bf16
  columns) need an even first row, and every piece but the last single row is an even count,
  so one row of shift when `offset` is odd; rows of 128 bytes or more need none."""
  if row_bytes % TMA_SMEM_ALIGN == 0:
    return 0
  return offset & 1


def plain_rows(block_m: int, row_bytes: int) -> int:
  """Rows of each warpgroup's plain epilogue buffer: a tile's and room for `plain_shift`'s
  row, two rows rather than one so that the second warpgroup's buffer, right after the
  first's, also starts TMA-aligned."""
  return block_m + (0 if row_bytes % TMA_SMEM_ALIGN == 0 else 2)


def _store_rows(o_smem, o_gmem, row0, lo, hi, col0, width, rows: int):
  """TMA-store smem rows [lo - row0, hi - row0) of `o_smem` ([rows, width]) to gmem rows
  [lo, hi): one store per set bit of the count, largest first (the pieces of `_ladder`)."""
  plgpu = _plgpu()
  count = hi - lo
  for size, offset in _ladder(lo - row0, count, rows):
    @pl.when((count & size) != 0)
    def _(size=size, offset=offset):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, size)],
                              o_gmem.at[pl.ds(row0 + offset, size), pl.ds(col0, width)])


def gmm(x_rowsxin, w_Cxinxout, group_sizes_C, *, block_m: int = 128, block_n: int = 128,
        block_k: int = 64, max_concurrent_steps: int = 4, split: str = "n",
        transpose_rhs: bool = False, chain: bool = True, epilogue_n: int = 32,
        num_sms: int = 132, interpret=None):
  """[rows, out] in x's dtype: row group g times w[g] (w [C, out, in] read transposed when
  `transpose_rhs`); rows past the last group are zeros. Each consumer warpgroup computes a
  block_m x block_n tile; the CTA's is twice that along `split` ('n' or 'm'). `chain`: one
  SM's tiles run as one pipeline (where block_k divides `in` into a multiple of
  max_concurrent_steps steps, which JAX's chaining needs), else a pipeline per tile. The
  epilogue goes through SMEM `epilogue_n` columns at a time (a smaller buffer leaves room
  for more steps in flight): a tile whose rows are all its group's through a swizzled buffer
  in one TMA store, one shared with another group through a plain one, row by row."""
  plgpu = _plgpu()
  m, k = x_rowsxin.shape
  num_groups = w_Cxinxout.shape[0]
  n = w_Cxinxout.shape[1] if transpose_rhs else w_Cxinxout.shape[2]
  dtype = x_rowsxin.dtype
  cta_m = block_m * (2 if split == "m" else 1)
  cta_n = block_n * (2 if split == "n" else 1)
  if why := gmm_unsupported(x_rowsxin, w_Cxinxout, block_m, block_n, block_k, split,
                            transpose_rhs, epilogue_n):
    raise ValueError(why)
  if m == 0 or num_groups == 0:
    return jnp.zeros((m, n), dtype)
  rows = m + (-m % cta_m)
  x_rowsxin = jnp.pad(x_rowsxin, ((0, rows - m), (0, 0)))
  tile, group, lo, hi, count = work_list(group_sizes_C, m, cta_m)
  n_tiles, k_steps = n // cta_n, k // block_k
  ab_transforms = _swizzled(dtype, block_k)
  b_transforms = ab_transforms if transpose_rhs else _swizzled(dtype, block_n)

  chained = chain and k_steps % max_concurrent_steps == 0
  epi_n = math.gcd(block_n, epilogue_n)
  row_bytes = epi_n * jnp.dtype(dtype).itemsize

  def body(count_ref, tile_ref, group_ref, lo_ref, hi_ref, x_gmem, w_gmem, o_gmem):
    wg = lax.axis_index("wg")
    wg_rows = pl.ds(wg * block_m, block_m) if split == "m" else slice(None)
    wg_cols = pl.ds(wg * block_n, block_n) if split == "n" else slice(None)

    def pipeline_for(mma, context, state=None):
      if transpose_rhs:
        b_spec = plgpu.BlockSpec((cta_n, block_k), lambda kk: (0, kk), transforms=b_transforms)
      else:
        b_spec = plgpu.BlockSpec((block_k, cta_n), lambda kk: (kk, 0), transforms=b_transforms)
      return plgpu.emit_pipeline_warp_specialized(
          mma, grid=(k_steps,), memory_registers=MEMORY_REGISTERS,
          in_specs=[plgpu.BlockSpec((cta_m, block_k), lambda kk: (0, kk),
                                    transforms=ab_transforms), b_spec],
          wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=max_concurrent_steps,
          compute_context=context, pipeline_state=state)

    ignore = lambda *_, **__: None
    x_block = x_gmem.at[pl.ds(0, cta_m)]
    w_block = (w_gmem.at[0].at[pl.ds(0, cta_n)] if transpose_rhs
               else w_gmem.at[0].at[:, pl.ds(0, cta_n)])

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline_for(ignore, ignore).get_allocations(x_block, w_block),
        swizzled_smem=plgpu.SMEM((2, block_m, epi_n), dtype, transforms=_swizzled(dtype, epi_n)),
        plain_smem=plgpu.SMEM((2, plain_rows(block_m, row_bytes), epi_n), dtype),
        collective_axes="wg")
    def _(allocs, swizzled_smem, plain_smem):
      def item(s):
        """(group, the CTA's first row, this warpgroup's column, a store of its tile's rows
        of pair s // n_tiles) for step s."""
        p, j = lax.div(s, n_tiles), lax.rem(s, n_tiles)
        row0 = tile_ref[p] * cta_m
        wg_row0 = row0 + (wg * block_m if split == "m" else 0)
        col0 = j * cta_n + (wg * block_n if split == "n" else 0)
        wg_lo = jnp.clip(lo_ref[p], wg_row0, wg_row0 + block_m)
        wg_hi = jnp.clip(hi_ref[p], wg_row0, wg_row0 + block_m)
        swizzled, plain = swizzled_smem.at[wg], plain_smem.at[wg]
        whole = (wg_lo == wg_row0) & (wg_hi == wg_row0 + block_m)

        def store(tile_block):
          for c in range(block_n // epi_n):     # through SMEM, epi_n columns at a time
            chunk, col = tile_block[:, c * epi_n:(c + 1) * epi_n], col0 + c * epi_n

            @pl.when(whole)      # all rows: a swizzled tile (no bank conflicts), one store
            def _(chunk=chunk, col=col):
              swizzled[...] = chunk
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(swizzled, o_gmem.at[pl.ds(wg_row0, block_m),
                                                          pl.ds(col, epi_n)])

            @pl.when(~whole)     # some rows: any row offset needs the plain layout
            def _(chunk=chunk, col=col):
              shifted = plain.at[pl.ds(plain_shift(wg_lo - wg_row0, row_bytes), block_m)]
              shifted[...] = chunk
              plgpu.commit_smem()
              _store_rows(shifted, o_gmem, wg_row0, wg_lo, wg_hi, col, epi_n, block_m)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        return group_ref[p], row0, j * cta_n, store

      # The pairs of real groups first; with `chained`, a tile's pipeline hands on to the
      # next one's (the producer loads the next tile while the consumers store this one).
      @plgpu.nd_loop((count_ref[0] * n_tiles,), collective_axes="sm")
      def _matmuls(info):
        g, row0, cta_col0, store = item(info.index[0])

        def context(run):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((block_m, block_n), jnp.float32))
          def _(acc):
            run(acc)
            store(acc[...].astype(dtype))

        def mma(_, a_smem, b_smem, acc):
          b = _transposed(b_smem.at[wg_cols]) if transpose_rhs else b_smem.at[:, wg_cols]
          plgpu.wgmma(acc, a_smem.at[wg_rows], b)
          plgpu.wgmma_wait(0)
          return acc

        w_g = w_gmem.at[g]
        w_cols = (w_g.at[pl.ds(cta_col0, cta_n)] if transpose_rhs
                  else w_g.at[:, pl.ds(cta_col0, cta_n)])
        def run(state):
          pipeline_for(mma, context, state)(x_gmem.at[pl.ds(row0, cta_m)], w_cols,
                                            allocations=allocs)

        if not chained:
          run(None)
          return
        # START on an SM's first tile (the producer's prologue), STOP on its last (it waits
        # for the consumers' last arrivals); an SM with one tile runs an unchained pipeline.
        alone = info.num_local_steps == 1
        first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
        pl.when(alone)(lambda: run(None))
        pl.when(~alone)(lambda: run(jnp.where(
            first, int(plgpu.PipelinePipeline.START),
            jnp.where(last, int(plgpu.PipelinePipeline.STOP),
                      int(plgpu.PipelinePipeline.STEADY)))))

      # Then the tail's pairs: zeros, stored by the consumers.
      @plgpu.nd_loop(((count_ref[1] - count_ref[0]) * n_tiles,), collective_axes="sm")
      def _tail(info):
        _, _, _, store = item(count_ref[0] * n_tiles + info.index[0])

        @pl.when(wg < 2)
        def _():
          store(jnp.zeros((block_m, block_n), dtype))

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((rows, n), dtype), grid=(num_sms,),
      grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **({} if interpret is None else {"interpret": interpret}))
  out = kernel(count, tile, group, lo, hi, x_rowsxin, w_Cxinxout)
  return out[:m]


def gmm_unsupported(x_rowsxin, w_Cxinxout, block_m, block_n, block_k, split,
                    transpose_rhs, epilogue_n: int = 32) -> str | None:
  """Why `gmm` cannot take these operands and tiles (None: it can)."""
  if x_rowsxin.dtype != w_Cxinxout.dtype or jnp.dtype(x_rowsxin.dtype).name not in TILE_DTYPES:
    return (f"the Hopper gmm needs bf16/f16 operands of one dtype, got {x_rowsxin.dtype} and "
            f"{w_Cxinxout.dtype}; cast them or use backend='triton'.")
  if split not in ("n", "m"):
    return f"the Hopper gmm's split={split!r} must be 'n' or 'm'."
  if block_m % WGMMA_ROWS:
    return f"the Hopper gmm's block_m={block_m} must be a multiple of {WGMMA_ROWS}."
  row_bytes = math.gcd(block_n, epilogue_n) * jnp.dtype(x_rowsxin.dtype).itemsize
  if row_bytes % (TMA_SMEM_ALIGN // 2):
    cols = TMA_SMEM_ALIGN // 2 // jnp.dtype(x_rowsxin.dtype).itemsize
    return (f"the Hopper gmm's epilogue rows of {row_bytes} bytes (gcd(block_n, epilogue_n) "
            f"columns) cannot all start {TMA_SMEM_ALIGN}-byte aligned; make block_n and "
            f"epilogue_n multiples of {cols}.")
  n = w_Cxinxout.shape[1] if transpose_rhs else w_Cxinxout.shape[2]
  cta_n = block_n * (2 if split == "n" else 1)
  for name, dim, tile in (("in", x_rowsxin.shape[1], block_k), ("out", n, cta_n)):
    if dim % tile:
      return (f"the Hopper gmm's {name} dim {dim} is not a multiple of its tile {tile}; pad it "
              "or use backend='triton'.")
  return None


def tgmm(x_rowsxin, dy_rowsxout, group_sizes_C, *, block_m: int = 128, block_n: int = 128,
         block_k: int = 64, max_concurrent_steps: int = 4, out_dtype=None, num_sms: int = 132,
         interpret=None):
  """[C, in, out]: per group g, x[rows of g]^T @ dy[rows of g] (zeros for an empty group).
  One warpgroup per (group, in tile, out tile), pipelining the group's rows in blocks of
  block_k aligned to block_k; the first and last blocks are masked to the group's rows."""
  plgpu = _plgpu()
  (m, k), n = x_rowsxin.shape, dy_rowsxout.shape[1]
  num_groups = group_sizes_C.shape[0]
  dtype = x_rowsxin.dtype
  out_dtype = jnp.dtype(out_dtype or dtype)
  if why := tgmm_unsupported(x_rowsxin, dy_rowsxout, block_m, block_n, block_k):
    raise ValueError(why)
  rows = m + (-m % block_k)
  x_rowsxin = jnp.pad(x_rowsxin, ((0, rows - m), (0, 0)))
  dy_rowsxout = jnp.pad(dy_rowsxout, ((0, rows - m), (0, 0)))
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_C.astype(jnp.int32), 0)), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  block_starts = starts // block_k * block_k
  num_blocks = jnp.where(ends > starts, pl.cdiv(ends, block_k) - starts // block_k, 0)
  x_transforms = _swizzled(dtype, block_m)
  dy_transforms = _swizzled(dtype, block_n)
  m_tiles, n_tiles = k // block_m, n // block_n

  def body(starts_ref, ends_ref, blocks_ref, block_starts_ref, x_gmem, dy_gmem, o_gmem):
    @plgpu.nd_loop((num_groups, m_tiles * n_tiles), collective_axes="sm")
    def _step(info):
      g, t = info.index
      mi, ni = lax.div(t, n_tiles), lax.rem(t, n_tiles)
      start, end, blocks = starts_ref[g], ends_ref[g], blocks_ref[g]
      first_row = pl.multiple_of(block_starts_ref[g], block_k)

      def masked(x_smem, keep):
        rows_iota = plgpu.layout_cast(
            lax.broadcasted_iota(jnp.int32, (block_k, block_m), 0), plgpu.Layout.WGMMA)
        x_smem[...] = x_smem[...] * keep(rows_iota).astype(dtype)
        plgpu.commit_smem()

      def acc_scope(acc):
        def step(idx, x_smem, dy_smem):
          (b,) = idx
          row0 = first_row + b * block_k

          @pl.when((b == 0) & (start > row0))
          def _():
            masked(x_smem, lambda r: r >= start - row0)

          @pl.when((b == blocks - 1) & (end < row0 + block_k))
          def _():
            masked(x_smem, lambda r: r < end - row0)

          plgpu.wgmma(acc, _transposed(x_smem), dy_smem)
          if max_concurrent_steps == 1:
            plgpu.wgmma_wait(0)

        @pl.when(blocks > 0)
        def _():
          release = 1 if max_concurrent_steps > 1 else 0
          plgpu.emit_pipeline(
              step, grid=(blocks,),
              in_specs=[plgpu.BlockSpec((block_k, block_m), lambda b: (b, mi),
                                        delay_release=release, transforms=x_transforms),
                        plgpu.BlockSpec((block_k, block_n), lambda b: (b, ni),
                                        delay_release=release, transforms=dy_transforms)],
              max_concurrent_steps=max_concurrent_steps,
          )(x_gmem.at[pl.ds(first_row, rows)], dy_gmem.at[pl.ds(first_row, rows)])
        return acc[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

      @functools.partial(pl.run_scoped,
                         o_smem=plgpu.SMEM((block_m, block_n), out_dtype,
                                           transforms=_swizzled(out_dtype, block_n)))
      def _(o_smem):
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem, o_gmem.at[g, pl.ds(mi * block_m, block_m), pl.ds(ni * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype), grid=(num_sms,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **({} if interpret is None else {"interpret": interpret}))
  return kernel(starts, ends, num_blocks, block_starts, x_rowsxin, dy_rowsxout)


def tgmm_unsupported(x_rowsxin, dy_rowsxout, block_m, block_n, block_k) -> str | None:
  """Why `tgmm` cannot take these operands and tiles (None: it can)."""
  if (x_rowsxin.dtype != dy_rowsxout.dtype
      or jnp.dtype(x_rowsxin.dtype).name not in TILE_DTYPES):
    return (f"the Hopper tgmm needs bf16/f16 operands of one dtype, got {x_rowsxin.dtype} and "
            f"{dy_rowsxout.dtype}; cast them or use backend='triton'.")
  for name, dim, tile in (("in", x_rowsxin.shape[1], block_m),
                          ("out", dy_rowsxout.shape[1], block_n)):
    if dim % tile:
      return (f"the Hopper tgmm's {name} dim {dim} is not a multiple of its tile {tile}; pad "
              "it or use backend='triton'.")
  if block_k % 8:
    return f"the Hopper tgmm's block_k={block_k} must be a multiple of 8."
  return None
