"""Row-gather kernels shared by permute and unpermute-combine (and their backward passes).

`gather_sum`:  out[r] = sum_k w[r, k] * src[idx[r, k]]     (idx outside [0, len(src)) adds 0)
`gather_dot`:  out[r, k] = <dy[r], src[idx[r, k]]>          (idx outside [0, len(src)) gives 0)

src is [rows in, D]; idx, w are [rows out, K]; dy is [rows out, D]. Rows in and out are
tokens or exchange-buffer rows depending on the caller, so they carry no shape letter.

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
def gather_sum(src, idx, w, *, out_dtype, block_rows, block_d, backend, num_warps=4):
  """[rows out, D]; `w` None: unweighted. `backend` resolved; `block_d` must divide D."""
  (num_src, d), (num_out, top_k) = src.shape, idx.shape
  if num_out == 0 or d == 0 or top_k == 0 or num_src == 0:
    return jnp.zeros((num_out, d), out_dtype)
  weighted = w is not None
  cols = [idx[:, k].astype(jnp.int32) for k in range(top_k)]
  if weighted:
    cols += [w[:, k].astype(jnp.float32) for k in range(top_k)]
  kernel = functools.partial(_gather_sum_kernel, top_k=top_k, weighted=weighted,
                             num_src=num_src, num_rows=num_out, block_rows=block_rows,
                             block_d=block_d)
  return pl.pallas_call(
      kernel,
      out_shape=backend_lib.out_struct((num_out, d), out_dtype, src, idx, *cols[top_k:]),
      grid=(pl.cdiv(num_out, block_rows), d // block_d), name="gather_sum",
      **backend_lib.call_kwargs(backend, num_warps))(*cols, src)


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
def gather_dot(dy, src, idx, *, block_rows, block_d, backend, num_warps=4):
  """float32 [rows out, K]; `block_d` must divide D."""
  (num_src, d), (num_out, top_k) = src.shape, idx.shape
  if num_out == 0 or d == 0 or top_k == 0 or num_src == 0:
    return jnp.zeros((num_out, top_k), jnp.float32)
  kernel = functools.partial(_gather_dot_kernel, top_k=top_k, num_src=num_src, num_rows=num_out,
                             block_rows=block_rows, block_d=block_d, d_blocks=d // block_d)
  outs = pl.pallas_call(
      kernel,
      out_shape=[backend_lib.out_struct((num_out,), jnp.float32, dy, src, idx)] * top_k,
      grid=(pl.cdiv(num_out, block_rows),), name="gather_dot",
      **backend_lib.call_kwargs(backend, num_warps))(
          *[idx[:, k].astype(jnp.int32) for k in range(top_k)], dy, src)
  return jnp.stack(outs, axis=1)
