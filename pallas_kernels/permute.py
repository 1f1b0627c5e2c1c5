"""Permute: gather token rows into expert/slot-contiguous order.

    out[u] = x[token_rows[u]]        (0 where token_rows[u] is outside [0, T): empty rows)

A row of x may be copied to several output rows (one per top-k choice), so the backward pass
is a scatter-add, done here as a gather by the inverse map `rows_TxK` (the output rows each
token was copied to, -1 padded): dx[t] = sum_k dout[rows_TxK[t, k]]. That is the
unpermute-combine kernel with unit weights; both run on `pallas_kernels.gather`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backend_lib
from pallas_kernels.gather import gather_sum


@dataclasses.dataclass(frozen=True)
class PermuteTuning:
  """Tiles of both gathers (forward: 1 index column; backward: K columns, K tiles in flight).

  sm_90a, bf16, configs/gpt_moe_gpu.gin's shapes (T = 8192, D = 768), registers / spill bytes
  per thread from `python -m benchmarks.kernels.gpu_compile`
  (benchmarks/kernels/results/gpu_compile_sm90a.json):

    block_rows x block_d  warps   backward top_k 8    note
    64 x 256              4       255 / 2984         spills: the old default
    64 x 256              8       155 / 0            the default: same tile, twice the threads
    64 x 128              4       113 / 0
    32 x 256              4       113 / 0
  """
  block_rows: int = 64      # output rows per program (power of two)
  block_d: int = 256        # feature tile; the largest power of two <= this dividing D
  num_warps: int = 8
  backend: str = "auto"     # see pallas_kernels.backend


def permute_reference(x_TxD: jax.Array, token_rows: jax.Array) -> jax.Array:
  ok = (token_rows >= 0) & (token_rows < x_TxD.shape[0])
  rows = x_TxD[jnp.where(ok, token_rows, 0)]
  return jnp.where(ok[:, None], rows, jnp.zeros((), x_TxD.dtype))


def invert(token_rows: jax.Array, num_tokens: int, max_copies: int) -> jax.Array:
  """rows_TxK for `permute`: the output rows holding each token, in row order, -1 padded.
  A token with more than `max_copies` rows loses the extra ones (and their gradient)."""
  r = token_rows.shape[0]
  key = jnp.where((token_rows >= 0) & (token_rows < num_tokens), token_rows, num_tokens)
  order = jnp.argsort(key, stable=True)
  counts = jnp.zeros((num_tokens + 1,), jnp.int32).at[key].add(1)
  starts = jnp.cumsum(counts) - counts
  rank = jnp.zeros((r,), jnp.int32).at[order].set(
      jnp.arange(r, dtype=jnp.int32) - starts[key[order]])
  out = jnp.full((num_tokens + 1, max_copies), -1, jnp.int32)
  return out.at[key, rank].set(jnp.arange(r, dtype=jnp.int32), mode="drop")[:num_tokens]


def _check(x_TxD, token_rows, rows_TxK, tuning):
  if x_TxD.ndim != 2:
    raise ValueError(f"permute: x has shape {x_TxD.shape}; it must be [tokens, D].")
  if token_rows.ndim != 1 or not jnp.issubdtype(token_rows.dtype, jnp.integer):
    raise ValueError(f"permute: token_rows is {token_rows.dtype}{list(token_rows.shape)}; it must "
                     "be a "
                     "1-D integer array (one source token per output row).")
  if rows_TxK.ndim != 2 or rows_TxK.shape[0] != x_TxD.shape[0]:
    raise ValueError(f"permute: rows_TxK has shape {rows_TxK.shape}; it must be "
                     f"[tokens={x_TxD.shape[0]}, K] (see permute.invert).")
  backend_lib.check_pow2("PermuteTuning.block_rows", tuning.block_rows)


def permute(x_TxD: jax.Array, token_rows: jax.Array, rows_TxK: jax.Array,
            tuning: PermuteTuning = PermuteTuning()) -> jax.Array:
  """[rows, D] in x's dtype. `rows_TxK` must be the inverse of `token_rows` (`invert` computes it);
  it is used by the backward pass only."""
  _check(x_TxD, token_rows, rows_TxK, tuning)
  return _permute(*backend_lib.match_varying(x_TxD, token_rows.astype(jnp.int32),
                                             rows_TxK.astype(jnp.int32)), tuning)


def _gather(src, idx, tuning, out_dtype):
  return gather_sum(src, idx, None, out_dtype=out_dtype, block_rows=tuning.block_rows,
                    block_d=backend_lib.pow2_tile(src.shape[1], tuning.block_d),
                    backend=backend_lib.resolve(tuning.backend), num_warps=tuning.num_warps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _permute(x_TxD, token_rows, rows_TxK, tuning):
  return _gather(x_TxD, token_rows[:, None], tuning, x_TxD.dtype)


def _permute_fwd(x_TxD, token_rows, rows_TxK, tuning):
  return _permute(x_TxD, token_rows, rows_TxK, tuning), rows_TxK


def _permute_bwd(tuning, rows_TxK, dout_rowsxD):   # dout has x's dtype
  return _gather(dout_rowsxD, rows_TxK, tuning, dout_rowsxD.dtype), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)
