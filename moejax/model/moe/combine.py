"""Combine: unpermute the returned rows and weight them by the router gates. The backward
gathers as well: each returned row holds at most one choice, so its gradient is that choice's
gate times its token's output gradient, fetched by the rows' inverse map (a scatter-add, as
autodiff of the forward gather would make, runs at a quarter of a gather's rate on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.model.moe.dispatch import BufferIndex, cotangent_of, inverse_rows


def _picked(out_rowsxD: jax.Array, row_TxK: jax.Array) -> jax.Array:
  """[T, K, D]: out[row_TxK[t, k]], zeros for row -1."""
  out_ext = jnp.concatenate(
      [out_rowsxD, jnp.zeros((1, out_rowsxD.shape[1]), out_rowsxD.dtype)], axis=0)
  return out_ext[jnp.where(row_TxK >= 0, row_TxK, out_rowsxD.shape[0])]


@jax.custom_vjp
def combine_rows(out_rowsxD: jax.Array, row_TxK: jax.Array, gate_TxK: jax.Array) -> jax.Array:
  """y[t] = sum_k gate[t, k] * out[row_TxK[t, k]]; rows -1 (dropped choices) contribute 0."""
  return jnp.einsum("tkd,tk->td", _picked(out_rowsxD, row_TxK).astype(jnp.float32), gate_TxK)


def _combine_fwd(out_rowsxD, row_TxK, gate_TxK):
  return combine_rows(out_rowsxD, row_TxK, gate_TxK), (out_rowsxD, row_TxK, gate_TxK)


def _combine_bwd(res, dy_TxD):
  out_rowsxD, row_TxK, gate_TxK = res
  num_tokens, top_k = gate_TxK.shape
  dgate_TxK = jnp.einsum("tkd,td->tk", _picked(out_rowsxD, row_TxK).astype(jnp.float32),
                         dy_TxD).astype(gate_TxK.dtype)
  choice_rows = inverse_rows(row_TxK, out_rowsxD.shape[0])         # T * K: an empty row
  gate_ext = jnp.concatenate([gate_TxK.reshape(-1), jnp.zeros((1,), gate_TxK.dtype)])
  dy_ext = jnp.concatenate([dy_TxD, jnp.zeros((1, dy_TxD.shape[1]), dy_TxD.dtype)])
  token_rows = jnp.where(choice_rows < num_tokens * top_k, choice_rows // top_k, num_tokens)
  dout = gate_ext[choice_rows][:, None].astype(jnp.float32) * dy_ext[token_rows].astype(jnp.float32)
  return (cotangent_of(dout.astype(out_rowsxD.dtype), out_rowsxD), None,
          cotangent_of(dgate_TxK, gate_TxK))


combine_rows.defvjp(_combine_fwd, _combine_bwd)


def combine(out_rowsxD: jax.Array, index: BufferIndex, gate_TxK: jax.Array) -> jax.Array:
  """y[t] = sum_k gate[t, k] * out[row of (t, k)]; dropped choices contribute 0."""
  return combine_rows(out_rowsxD, index.buf_index_TK.reshape(gate_TxK.shape), gate_TxK)
