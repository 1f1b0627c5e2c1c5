"""The MoE layer at inference: every (token, k) choice computed, none dropped for capacity.

Decoding routes a handful of tokens a step, so a capacity of cf * T * K / E rows per expert
would drop whole choices at random (one token of a batch of four sent to a busy expert is a
quarter of that expert's load); the sampled text would then depend on which other prompts share
the batch. Here the choices are sorted by expert and run as one grouped matmul
(`jax.lax.ragged_dot`) over exactly the rows each expert got: the FLOPs of T * K choices,
whatever the balance. The expert weights are in canonical (expert-id) order, as
`moejax.layout.canonical.canonical_state` gives them for either expert mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.model.moe.experts import swiglu_grouped


def _ragged_dot(x_rowsxin, w_Cxinxout, sizes_C):
  return jax.lax.ragged_dot(x_rowsxin, w_Cxinxout, sizes_C)


def dropless_experts(x_TxD: jax.Array, expert_TxK: jax.Array, gate_TxK: jax.Array,
                     w_gate_ExDxffn: jax.Array, w_up_ExDxffn: jax.Array,
                     w_down_ExffnxD: jax.Array, dtype=jnp.float32) -> jax.Array:
  """y_TxD (x's dtype): sum_k gate[t, k] * SwiGLU_{expert[t, k]}(x[t]), each expert's rows
  through its weights once (rows grouped by expert, a stable sort: ties keep token order)."""
  num_tokens, top_k = expert_TxK.shape
  num_experts = w_gate_ExDxffn.shape[0]
  expert_TK = expert_TxK.reshape(-1)                      # the T * K choices, token-major
  order_TK = jnp.argsort(expert_TK, stable=True)
  sizes_E = jnp.bincount(expert_TK, length=num_experts).astype(jnp.int32)
  rows_TKxD = x_TxD[order_TK // top_k]
  y_TKxD = swiglu_grouped(rows_TKxD, sizes_E, w_gate_ExDxffn, w_up_ExDxffn, w_down_ExffnxD,
                         _ragged_dot, dtype)
  back_TKxD = jnp.zeros_like(y_TKxD).at[order_TK].set(y_TKxD)   # to (token, k) order
  y_TxD = jnp.einsum("tkd,tk->td", back_TKxD.reshape(num_tokens, top_k, -1).astype(jnp.float32),
                     gate_TxK.astype(jnp.float32))
  return y_TxD.astype(x_TxD.dtype)
