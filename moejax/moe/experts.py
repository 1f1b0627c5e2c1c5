"""Per-slot SwiGLU experts over grouped tokens (batched einsum)."""

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
