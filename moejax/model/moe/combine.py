"""Combine: unpermute the returned rows and weight them by the router gates."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.model.moe.dispatch import BufferIndex


def combine_rows(out_rowsxD: jax.Array, row_TxK: jax.Array, gate_TxK: jax.Array) -> jax.Array:
  """y[t] = sum_k gate[t, k] * out[row_TxK[t, k]]; rows -1 (dropped choices) contribute 0."""
  num_tokens, top_k = gate_TxK.shape
  out_ext = jnp.concatenate(
      [out_rowsxD, jnp.zeros((1, out_rowsxD.shape[1]), out_rowsxD.dtype)], axis=0)
  rows_TK = jnp.where(row_TxK.reshape(-1) >= 0, row_TxK.reshape(-1), out_rowsxD.shape[0])
  y_TxKxD = out_ext[rows_TK].reshape(num_tokens, top_k, -1)
  return jnp.einsum("tkd,tk->td", y_TxKxD.astype(jnp.float32), gate_TxK)


def combine(out_rowsxD: jax.Array, index: BufferIndex, gate_TxK: jax.Array) -> jax.Array:
  """y[t] = sum_k gate[t, k] * out[row of (t, k)]; dropped choices contribute 0."""
  return combine_rows(out_rowsxD, index.buf_index_TK.reshape(gate_TxK.shape), gate_TxK)
