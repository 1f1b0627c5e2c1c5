"""Per-slot SwiGLU experts: batched einsum over fixed-capacity rows, or a grouped matmul
over packed row groups (group sizes as data)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu(x_CxRxD: jax.Array, w_gate_CxDxF: jax.Array, w_up_CxDxF: jax.Array,
           w_down_CxFxD: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Each slot c applies its own SwiGLU to its R rows. With F sharded over a
  mesh axis the result is a partial sum that the caller reduces."""
  x = x_CxRxD.astype(dtype)
  gate_CxRxF = jnp.einsum("crd,cdf->crf", x, w_gate_CxDxF.astype(dtype))
  up_CxRxF = jnp.einsum("crd,cdf->crf", x, w_up_CxDxF.astype(dtype))
  h_CxRxF = jax.nn.silu(gate_CxRxF) * up_CxRxF
  return jnp.einsum("crf,cfd->crd", h_CxRxF, w_down_CxFxD.astype(dtype))


def swiglu_grouped(x_MxD: jax.Array, sizes_C: jax.Array, w_gate_CxDxF: jax.Array,
                   w_up_CxDxF: jax.Array, w_down_CxFxD: jax.Array, gmm,
                   dtype=jnp.float32) -> jax.Array:
  """The same SwiGLU over packed row groups: rows of group c use slot c's weights; rows past
  the groups give zeros. `gmm` is a grouped matmul (see moejax.moe.kernels)."""
  x = x_MxD.astype(dtype)
  gate_MxF = gmm(x, w_gate_CxDxF.astype(dtype), sizes_C)
  up_MxF = gmm(x, w_up_CxDxF.astype(dtype), sizes_C)
  return gmm(jax.nn.silu(gate_MxF) * up_MxF, w_down_CxFxD.astype(dtype), sizes_C)


def grouped_ffn(recv_RxD: jax.Array, g, weights: tuple, ops, dtype) -> jax.Array:
  """Received rows -> slot groups (`g`: a moejax.moe.grouping.Grouping) -> SwiGLU -> sum of
  the F shards over 'model' -> back to the received order (empty rows stay zero)."""
  x_MxD = ops.permute(recv_RxD, g.recv_row_M, g.group_row_R[:, None])
  y_MxD = jax.lax.psum(swiglu_grouped(x_MxD, g.sizes_C, *weights, ops.gmm, dtype), "model")
  return ops.permute(y_MxD, g.group_row_R, g.recv_row_M[:, None])
