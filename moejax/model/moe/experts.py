"""Per-slot SwiGLU experts: batched einsum over fixed-capacity rows, or a grouped matmul
over packed row groups (group sizes as data)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu(x_CxrowsxD: jax.Array, w_gate_CxDxffn: jax.Array, w_up_CxDxffn: jax.Array,
           w_down_CxffnxD: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Each slot c applies its own SwiGLU to its rows. With the ffn width sharded over a
  mesh axis the result is a partial sum that the caller reduces."""
  x = x_CxrowsxD.astype(dtype)
  gate_Cxrowsxffn = jnp.einsum("cud,cdf->cuf", x, w_gate_CxDxffn.astype(dtype))
  up_Cxrowsxffn = jnp.einsum("cud,cdf->cuf", x, w_up_CxDxffn.astype(dtype))
  h_Cxrowsxffn = jax.nn.silu(gate_Cxrowsxffn) * up_Cxrowsxffn
  return jnp.einsum("cuf,cfd->cud", h_Cxrowsxffn, w_down_CxffnxD.astype(dtype))


def swiglu_grouped(x_rowsxD: jax.Array, sizes_C: jax.Array, w_gate_CxDxffn: jax.Array,
                   w_up_CxDxffn: jax.Array, w_down_CxffnxD: jax.Array, gmm,
                   dtype=jnp.float32) -> jax.Array:
  """The same SwiGLU over packed row groups: rows of group c use slot c's weights; rows past
  the groups give zeros. `gmm` is a grouped matmul (see moejax.model.moe.ops)."""
  x = x_rowsxD.astype(dtype)
  gate_rowsxffn = gmm(x, w_gate_CxDxffn.astype(dtype), sizes_C)
  up_rowsxffn = gmm(x, w_up_CxDxffn.astype(dtype), sizes_C)
  return gmm(jax.nn.silu(gate_rowsxffn) * up_rowsxffn, w_down_CxffnxD.astype(dtype), sizes_C)


def grouped_ffn(recv_rowsxD: jax.Array, g, weights: tuple, ops, dtype) -> jax.Array:
  """Received rows -> slot groups (`g`: a moejax.model.moe.grouping.Grouping) -> SwiGLU -> back
  to the received order (empty rows stay zero). With F sharded over 'model' the rows are
  partial sums; the layer sums them once, after the combine."""
  x_rowsxD = ops.permute(recv_rowsxD, g.recv_row, g.group_row[:, None])
  y_rowsxD = swiglu_grouped(x_rowsxD, g.sizes_C, *weights, ops.gmm, dtype)
  return ops.permute(y_rowsxD, g.group_row, g.recv_row[:, None])
