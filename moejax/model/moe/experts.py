"""Per-slot SwiGLU experts: batched einsum over fixed-capacity rows, or a grouped matmul
over packed row groups (group sizes as data)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu(x_CxUxD: jax.Array, w_gate_CxDxF: jax.Array, w_up_CxDxF: jax.Array,
           w_down_CxFxD: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Each slot c applies its own SwiGLU to its U rows. With F sharded over a
  mesh axis the result is a partial sum that the caller reduces."""
  x = x_CxUxD.astype(dtype)
  gate_CxUxF = jnp.einsum("cud,cdf->cuf", x, w_gate_CxDxF.astype(dtype))
  up_CxUxF = jnp.einsum("cud,cdf->cuf", x, w_up_CxDxF.astype(dtype))
  h_CxUxF = jax.nn.silu(gate_CxUxF) * up_CxUxF
  return jnp.einsum("cuf,cfd->cud", h_CxUxF, w_down_CxFxD.astype(dtype))


def swiglu_grouped(x_MxD: jax.Array, sizes_C: jax.Array, w_gate_CxDxF: jax.Array,
                   w_up_CxDxF: jax.Array, w_down_CxFxD: jax.Array, gmm,
                   dtype=jnp.float32) -> jax.Array:
  """The same SwiGLU over packed row groups: rows of group c use slot c's weights; rows past
  the groups give zeros. `gmm` is a grouped matmul (see moejax.model.moe.ops)."""
  x = x_MxD.astype(dtype)
  gate_MxF = gmm(x, w_gate_CxDxF.astype(dtype), sizes_C)
  up_MxF = gmm(x, w_up_CxDxF.astype(dtype), sizes_C)
  return gmm(jax.nn.silu(gate_MxF) * up_MxF, w_down_CxFxD.astype(dtype), sizes_C)


def grouped_ffn(recv_UxD: jax.Array, g, weights: tuple, ops, dtype) -> jax.Array:
  """Received rows -> slot groups (`g`: a moejax.model.moe.grouping.Grouping) -> SwiGLU -> back
  to the received order (empty rows stay zero). With F sharded over 'model' the rows are
  partial sums; the layer sums them once, after the combine."""
  x_MxD = ops.permute(recv_UxD, g.recv_row_M, g.group_row_U[:, None])
  y_MxD = swiglu_grouped(x_MxD, g.sizes_C, *weights, ops.gmm, dtype)
  return ops.permute(y_MxD, g.group_row_U, g.recv_row_M[:, None])
