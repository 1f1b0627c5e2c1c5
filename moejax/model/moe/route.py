"""Routing: router logits -> top-k experts and gate weights, plus the aux losses.

Works on one device's tokens. The aux losses are means over the *global* batch:
pass the names of the mesh axes the tokens are sharded over and the sums are
reduced across them, so the sharded layer equals the single-device reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
  expert_TxK: jax.Array      # int32 chosen experts
  gate_TxK: jax.Array        # float32 combine weights
  counts_E: jax.Array        # int32 (token, k) choices per expert, this device's tokens
  balance_loss: jax.Array    # scalar, switch load-balance loss (global)
  z_loss: jax.Array          # scalar, router z-loss (global)


def _global_mean(x_sum: jax.Array, n: jax.Array | int, axes: Sequence[str]) -> jax.Array:
  if axes:
    x_sum = jax.lax.psum(x_sum, tuple(axes))
    n = jax.lax.psum(n, tuple(axes))
  return x_sum / n


def route(x_TxD: jax.Array, w_router_DxE: jax.Array, top_k: int, *, normalize_top_k: bool,
          token_axes: Sequence[str] = (), bias_E: jax.Array | None = None) -> Routing:
  """`bias_E` (probability units) is added to the router probabilities for the *choice* of
  experts only; the gates stay the unbiased probabilities (aux-loss-free balancing, or load
  injection). A zero bias chooses exactly as no bias."""
  num_tokens = x_TxD.shape[0]
  num_experts = w_router_DxE.shape[1]
  logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), w_router_DxE.astype(jnp.float32))
  probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
  if bias_E is None:
    gate_TxK, expert_TxK = jax.lax.top_k(probs_TxE, top_k)
  else:
    _, expert_TxK = jax.lax.top_k(probs_TxE + jax.lax.stop_gradient(bias_E), top_k)
    gate_TxK = jnp.take_along_axis(probs_TxE, expert_TxK, axis=-1)
  if normalize_top_k and top_k > 1:   # a single gate renormalised to 1 would cut the router
    gate_TxK = gate_TxK / jnp.sum(gate_TxK, axis=-1, keepdims=True)

  onehot_TxKxE = jax.nn.one_hot(expert_TxK, num_experts, dtype=jnp.int32)
  counts_E = jnp.sum(onehot_TxKxE, axis=(0, 1))
  # Switch balance loss: E * sum_e (fraction of choices to e) * (mean prob of e).
  frac_E = _global_mean(counts_E.astype(jnp.float32), num_tokens * top_k, token_axes)
  prob_E = _global_mean(jnp.sum(probs_TxE, axis=0), num_tokens, token_axes)
  balance_loss = num_experts * jnp.sum(jax.lax.stop_gradient(frac_E) * prob_E)
  z_loss = _global_mean(jnp.sum(jax.nn.logsumexp(logits_TxE, axis=-1) ** 2), num_tokens,
                        token_axes)
  return Routing(expert_TxK.astype(jnp.int32), gate_TxK, counts_E, balance_loss, z_loss)
