"""Row-gather kernels shared by permute and unpermute-combine (and their backward passes).

`gather_sum`:  out[m] = sum_k w[m, k] * src[idx[m, k]]          (idx outside [0, N) adds 0)
`gather_dot`:  out[m, k] = <dy[m], src[idx[m, k]]>               (idx outside [0, N) gives 0)

Both are per-device `pallas_call`s over a grid of row blocks (and D tiles for `gather_sum`);
the K index columns are passed as K separate vectors so every loaded block is a power of two
(Triton). Scattered source rows are read with a vector-indexed load clamped to row 0 and
then zeroed; the tail row block is handled with masked loads and stores, so no input or
output is padded. Accumulation is float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend as backend_lib


def _gather_sum_kernel(*refs, top_k, weighted, num_src, num_rows, block_rows, block_d):
  idx_refs = refs[:top_k]
  w_refs = refs[top_k:2 * top_k] if weighted else ()
  src_ref, out_ref = refs[-2], refs[-1]
  i, j = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(i * block_rows, block_rows)
  cols = pl.ds(pl.multiple_of(j * block_d, block_d), block_d)
  row_ok = i * block_rows + jnp.arange(block_rows) < num_rows
  acc = jnp.zeros((block_rows, block_d), jnp.float32)
  for k in range(top_k):
    idx = pltriton.load(idx_refs[k].at[rows], mask=row_ok, other=-1)
    ok = (idx >= 0) & (idx < num_src)
    v = src_ref[jnp.where(ok, idx, 0), cols].astype(jnp.float32)
    if weighted:
      v = v * pltriton.load(w_refs[k].at[rows], mask=row_ok, other=0.0)[:, None]
    acc += jnp.where(ok[:, None], v, 0.0)
  pltriton.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_rows", "block_d", "backend",
                                             "num_warps"))
def gather_sum(src_NxD, idx_MxK, w_MxK, *, out_dtype, block_rows, block_d, backend,
               num_warps=4):
  """`w_MxK` None: unweighted. `backend` resolved; `block_d` must divide D."""
  (num_src, d), (m, top_k) = src_NxD.shape, idx_MxK.shape
  if m == 0 or d == 0 or top_k == 0 or num_src == 0:
    return jnp.zeros((m, d), out_dtype)
  weighted = w_MxK is not None
  cols = [idx_MxK[:, k].astype(jnp.int32) for k in range(top_k)]
  if weighted:
    cols += [w_MxK[:, k].astype(jnp.float32) for k in range(top_k)]
  kernel = functools.partial(_gather_sum_kernel, top_k=top_k, weighted=weighted,
                             num_src=num_src, num_rows=m, block_rows=block_rows,
                             block_d=block_d)
  return pl.pallas_call(
      kernel,
      out_shape=backend_lib.out_struct((m, d), out_dtype, src_NxD, idx_MxK, *cols[top_k:]),
      grid=(pl.cdiv(m, block_rows), d // block_d), name="gather_sum",
      **backend_lib.call_kwargs(backend, num_warps))(*cols, src_NxD)


def _gather_dot_kernel(*refs, top_k, num_src, num_rows, block_rows, block_d, d_blocks):
  idx_refs, (dy_ref, src_ref), out_refs = refs[:top_k], refs[top_k:top_k + 2], refs[top_k + 2:]
  i = pl.program_id(0)
  rows = pl.ds(i * block_rows, block_rows)
  row_ok = i * block_rows + jnp.arange(block_rows) < num_rows
  idx = [pltriton.load(r.at[rows], mask=row_ok, other=-1) for r in idx_refs]
  ok = [(v >= 0) & (v < num_src) for v in idx]
  safe = [jnp.where(o, v, 0) for o, v in zip(ok, idx)]

  def body(c, accs):
    cols = pl.ds(pl.multiple_of(c * block_d, block_d), block_d)
    dy = pltriton.load(dy_ref.at[rows, cols], mask=row_ok[:, None], other=0.0)
    dy = dy.astype(jnp.float32)
    return tuple(acc + jnp.sum(dy * src_ref[s, cols].astype(jnp.float32), axis=1)
                 for acc, s in zip(accs, safe))

  accs = jax.lax.fori_loop(0, d_blocks, body, (jnp.zeros((block_rows,), jnp.float32),) * top_k)
  for out_ref, o, acc in zip(out_refs, ok, accs):
    pltriton.store(out_ref.at[rows], jnp.where(o, acc, 0.0), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("block_rows", "block_d", "backend", "num_warps"))
def gather_dot(dy_MxD, src_NxD, idx_MxK, *, block_rows, block_d, backend, num_warps=4):
  """float32 [M, K]; `block_d` must divide D."""
  (num_src, d), (m, top_k) = src_NxD.shape, idx_MxK.shape
  if m == 0 or d == 0 or top_k == 0 or num_src == 0:
    return jnp.zeros((m, top_k), jnp.float32)
  kernel = functools.partial(_gather_dot_kernel, top_k=top_k, num_src=num_src, num_rows=m,
                             block_rows=block_rows, block_d=block_d, d_blocks=d // block_d)
  outs = pl.pallas_call(
      kernel,
      out_shape=[backend_lib.out_struct((m,), jnp.float32, dy_MxD, src_NxD, idx_MxK)] * top_k,
      grid=(pl.cdiv(m, block_rows),), name="gather_dot",
      **backend_lib.call_kwargs(backend, num_warps))(
          *[idx_MxK[:, k].astype(jnp.int32) for k in range(top_k)], dy_MxD, src_NxD)
  return jnp.stack(outs, axis=1)
