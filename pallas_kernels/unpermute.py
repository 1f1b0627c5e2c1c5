"""Unpermute-combine: gather each token's expert outputs back, weight by the gates, sum over k.

    y[t] = sum_k gate[t, k] * rows[row_TxK[t, k]]      (row -1 or >= U: adds 0, a dropped choice)

Contract: every row is used by at most one (t, k) (true of a dispatch, where a row holds one
choice). The backward pass relies on it:
    d rows[u]      = gate[t, k] * dy[t]       for the (t, k) that uses u, else 0 (a gather),
    d gate[t, k]   = <dy[t], rows[row_TxK[t, k]]>                               (a gather-dot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backend_lib
from pallas_kernels.gather import gather_dot, gather_sum


@dataclasses.dataclass(frozen=True)
class CombineTuning:
  """Tiles of the combine (K gated rows per token) and of its backward gathers; the gate
  gradient's gather-dot keeps K accumulators and K source tiles live, so it steps through D
  by its own, smaller `dot_block_d`.

  sm_90a, bf16, configs/gpt_moe_gpu.gin's shapes (T = 8192, D = 768), top_k 8, registers /
  spill bytes per thread from `python -m benchmarks.kernels.gpu_compile`:

    block_rows x block_d  warps   combine fwd    gather-dot (d gate)
    64 x 256              4       255 / 2624     255 / 2520            the old default
    64 x 256              8       194 / 0        255 / 168
    64 x 128              8       115 / 0        127 / 0               gather-dot's default
    64 x 64               8        62 / 0         80 / 24
    32 x 128              8        63 / 0         80 / 0
  Default: 64 x 256 for the combine, 64 x 128 for the gather-dot, 8 warps.
  """
  block_rows: int = 64      # tokens per program (power of two)
  block_d: int = 256        # feature tile; the largest power of two <= this dividing D
  dot_block_d: int = 128    # the gate gradient's step through D (at most block_d)
  num_warps: int = 8
  backend: str = "auto"     # see pallas_kernels.backend


def unpermute_combine_reference(buf_rowsxD, row_TxK, gate_TxK, out_dtype=jnp.float32):
  ok = (row_TxK >= 0) & (row_TxK < buf_rowsxD.shape[0])
  picked = buf_rowsxD[jnp.where(ok, row_TxK, 0)].astype(jnp.float32)       # [T, K, D]
  weights = jnp.where(ok, gate_TxK.astype(jnp.float32), 0.0)
  return jnp.einsum("tkd,tk->td", picked, weights).astype(out_dtype)


def _check(buf_rowsxD, row_TxK, gate_TxK, tuning):
  if buf_rowsxD.ndim != 2:
    raise ValueError(f"unpermute_combine: rows has shape {buf_rowsxD.shape}; it must be [rows, D].")
  if row_TxK.ndim != 2 or not jnp.issubdtype(row_TxK.dtype, jnp.integer):
    raise ValueError(f"unpermute_combine: row_TxK is {row_TxK.dtype}{list(row_TxK.shape)}; it "
                     "must be a 2-D integer array [tokens, K].")
  if gate_TxK.shape != row_TxK.shape:
    raise ValueError(f"unpermute_combine: gate shape {gate_TxK.shape} must equal row_TxK "
                     f"shape {row_TxK.shape}.")
  backend_lib.check_pow2("CombineTuning.block_rows", tuning.block_rows)


def unpermute_combine(buf_rowsxD: jax.Array, row_TxK: jax.Array, gate_TxK: jax.Array,
                      tuning: CombineTuning = CombineTuning(),
                      out_dtype=jnp.float32) -> jax.Array:
  """[T, D] in `out_dtype`, accumulated in float32."""
  _check(buf_rowsxD, row_TxK, gate_TxK, tuning)
  args = backend_lib.match_varying(buf_rowsxD, row_TxK.astype(jnp.int32), gate_TxK)
  return _combine(*args, tuning, jnp.dtype(out_dtype))


def _kw(tuning, d):
  return dict(block_rows=tuning.block_rows, block_d=backend_lib.pow2_tile(d, tuning.block_d),
              backend=backend_lib.resolve(tuning.backend), num_warps=tuning.num_warps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _combine(buf_rowsxD, row_TxK, gate_TxK, tuning, out_dtype):
  return gather_sum(buf_rowsxD, row_TxK, gate_TxK, out_dtype=out_dtype,
                    **_kw(tuning, buf_rowsxD.shape[1]))


def _combine_fwd(buf_rowsxD, row_TxK, gate_TxK, tuning, out_dtype):
  return _combine(buf_rowsxD, row_TxK, gate_TxK, tuning, out_dtype), (buf_rowsxD, row_TxK, gate_TxK)


def _combine_bwd(tuning, out_dtype, res, dy_TxD):
  del out_dtype
  buf_rowsxD, row_TxK, gate_TxK = res
  num_rows = buf_rowsxD.shape[0]
  top_k = row_TxK.shape[1]
  flat = row_TxK.reshape(-1)
  target = jnp.where((flat >= 0) & (flat < num_rows), flat, num_rows)
  choice_rows = jnp.full((num_rows,), -1, jnp.int32).at[target].set(
      jnp.arange(flat.shape[0], dtype=jnp.int32), mode="drop")
  used = choice_rows >= 0
  token_rows = jnp.where(used, choice_rows // top_k, -1)
  w_rows = jnp.where(used, gate_TxK.reshape(-1)[jnp.maximum(choice_rows, 0)], 0.0)
  kw = _kw(tuning, buf_rowsxD.shape[1])
  d_rows = gather_sum(dy_TxD, token_rows[:, None], w_rows[:, None], out_dtype=buf_rowsxD.dtype,
                      **kw)
  d_gate = gather_dot(dy_TxD, buf_rowsxD, row_TxK, **dict(kw, block_d=backend_lib.pow2_tile(
      buf_rowsxD.shape[1], min(tuning.block_d, tuning.dot_block_d))))
  return d_rows, None, d_gate.astype(gate_TxK.dtype)


_combine.defvjp(_combine_fwd, _combine_bwd)
