"""Routing: router logits -> top-k experts and gate weights, plus the aux losses.

Works on one device's tokens. The aux losses are means over the *global* batch:
pass the names of the mesh axes the tokens are sharded over and the sums are
reduced across them, so the sharded layer equals the single-device reference.

Two gates (`moe.gate`): "softmax" scores with the switch balance loss over the batch, and
"sigmoid" scores (DeepSeek-V3) with a sequence-wise balance loss. Either way a bias added to
the scores chooses the experts and the gates are the unbiased scores of the chosen ones.

Two limits narrow the choice before the top-k: by expert groups (`group_mask`, DeepSeek-V3's
group-limited routing over contiguous expert ids) or by the devices of the current layout
(`device_mask`, DeepSeek-V2's device-limited routing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moejax.model.moe import kept_exchange

# The name of the balance loss's global shares of choices per expert, for remat policies: the
# one value of the routing whose recompute is a collective (a psum over the token axes) that
# the loss's gradient needs, so a rematerialised layer keeps it (moejax.model.transformer);
# fsep's layer, recomputed in its own backward, keeps it on a tape (kept_exchange).
SHARES = "moe_route_shares"


class Routing(NamedTuple):
  expert_TxK: jax.Array      # int32 chosen experts
  gate_TxK: jax.Array        # float32 combine weights
  counts_E: jax.Array        # int32 (token, k) choices per expert, this device's tokens
  balance_loss: jax.Array    # scalar, load-balance loss (global)
  z_loss: jax.Array          # scalar, router z-loss (global)


def _global_mean(x_sum: jax.Array, n: jax.Array | int, axes: Sequence[str]) -> jax.Array:
  if axes:
    x_sum = jax.lax.psum(x_sum, tuple(axes))
    n = jax.lax.psum(n, tuple(axes))
  return x_sum / n


def device_mask(choice_TxE: jax.Array, hosts_ExN: jax.Array, device_limit: int) -> jax.Array:
  """bool [T, E]: the experts hosted on each token's `device_limit` best devices, a device
  scoring the best `choice_TxE` among the experts it hosts (`hosts_ExN`, bool)."""
  hosted_TxExN = jnp.where(hosts_ExN[None], choice_TxE[:, :, None], -jnp.inf)
  _, device_Txlimit = jax.lax.top_k(jnp.max(hosted_TxExN, axis=1), device_limit)
  return jnp.any(hosts_ExN.T[device_Txlimit], axis=1)


def group_mask(choice_TxE: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
  """bool [T, E]: the experts of each token's `topk_groups` best groups, the E experts cut
  into `num_groups` groups of contiguous ids and a group scoring the sum of its two best
  `choice_TxE` (DeepSeek-V3's group-limited routing; its groups are its nodes)."""
  num_tokens, num_experts = choice_TxE.shape
  per_group = num_experts // num_groups
  top2_Txgroupsx2, _ = jax.lax.top_k(choice_TxE.reshape(num_tokens, num_groups, per_group), 2)
  _, group_Txtopk = jax.lax.top_k(jnp.sum(top2_Txgroupsx2, axis=-1), topk_groups)
  allowed_Txgroups = jnp.any(jax.nn.one_hot(group_Txtopk, num_groups, dtype=jnp.bool_), axis=1)
  return jnp.repeat(allowed_Txgroups, per_group, axis=1)


def _scores(logits_TxE: jax.Array, gate: str) -> jax.Array:
  if gate == "sigmoid":
    return jax.nn.sigmoid(logits_TxE)
  return jax.nn.softmax(logits_TxE, axis=-1)


def _balance_loss(gate, scores_TxE, counts_TxE, top_k, seq_len, token_axes):
  """softmax: the switch loss E * sum_e (share of choices to e) * (mean prob of e) over the
  global batch. sigmoid: the same product per sequence, with scores normalised per token,
  averaged over the sequences (DeepSeek-V3's sequence-wise loss)."""
  num_tokens, num_experts = scores_TxE.shape
  if gate == "softmax":
    frac_E = checkpoint_name(kept_exchange.shares(
        lambda: _global_mean(jnp.sum(counts_TxE, 0), num_tokens * top_k, token_axes)), SHARES)
    prob_E = _global_mean(jnp.sum(scores_TxE, axis=0), num_tokens, token_axes)
    return num_experts * jnp.sum(jax.lax.stop_gradient(frac_E) * prob_E)
  norm_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
  seqs = num_tokens // seq_len
  frac_BxE = jnp.sum(counts_TxE.reshape(seqs, seq_len, num_experts), 1) / (seq_len * top_k)
  prob_BxE = jnp.mean(norm_TxE.reshape(seqs, seq_len, num_experts), 1)
  per_seq_B = num_experts * jnp.sum(jax.lax.stop_gradient(frac_BxE) * prob_BxE, -1)
  return _global_mean(jnp.sum(per_seq_B), seqs, token_axes)


def route(x_TxD: jax.Array, w_router_DxE: jax.Array, top_k: int, *, normalize_top_k: bool,
          token_axes: Sequence[str] = (), bias_E: jax.Array | None = None,
          gate: str = "softmax", route_scale: float = 1.0, seq_len: int = 0,
          hosts_ExN: jax.Array | None = None, device_limit: int = 0, num_groups: int = 1,
          topk_groups: int = 1) -> Routing:
  """`bias_E` (score units) is added to the scores for the *choice* of experts only; the
  gates stay the unbiased scores (aux-loss-free balancing, or load injection). A zero bias
  chooses exactly as no bias. `seq_len`: tokens per sequence for the sigmoid gate's
  sequence-wise loss (0: this device's tokens are one sequence). `hosts_ExN` with
  `device_limit` = M > 0: choose among the experts of the token's M best devices only.
  `num_groups` > 1: choose among the experts of the token's `topk_groups` best groups only."""
  num_tokens = x_TxD.shape[0]
  num_experts = w_router_DxE.shape[1]
  logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), w_router_DxE.astype(jnp.float32))
  scores_TxE = _scores(logits_TxE, gate)
  grouped = num_groups > 1 and topk_groups < num_groups
  if bias_E is None and not device_limit and not grouped:
    gate_TxK, expert_TxK = jax.lax.top_k(scores_TxE, top_k)
  else:
    choice_TxE = jax.lax.stop_gradient(scores_TxE)
    if bias_E is not None:
      choice_TxE = choice_TxE + jax.lax.stop_gradient(bias_E)
    if grouped:
      allowed_TxE = group_mask(choice_TxE, num_groups, topk_groups)
      choice_TxE = jnp.where(allowed_TxE, choice_TxE, -jnp.inf)
    if device_limit:
      allowed_TxE = device_mask(choice_TxE, hosts_ExN, device_limit)
      choice_TxE = jnp.where(allowed_TxE, choice_TxE, -jnp.inf)
    _, expert_TxK = jax.lax.top_k(choice_TxE, top_k)
    gate_TxK = jnp.take_along_axis(scores_TxE, expert_TxK, axis=-1)
  # A single softmax gate renormalised to 1 would cut the router's gradient; a sigmoid one
  # keeps it (s / s is 1 too), so sigmoid normalises only for k > 1 as well.
  if normalize_top_k and top_k > 1:
    gate_TxK = gate_TxK / jnp.sum(gate_TxK, axis=-1, keepdims=True)
  gate_TxK = gate_TxK * route_scale

  counts_TxE = jnp.sum(jax.nn.one_hot(expert_TxK, num_experts, dtype=jnp.float32), axis=1)
  counts_E = jnp.sum(counts_TxE, axis=0).astype(jnp.int32)
  balance_loss = _balance_loss(gate, scores_TxE, counts_TxE, top_k, seq_len or num_tokens,
                               token_axes)
  z_loss = _global_mean(jnp.sum(jax.nn.logsumexp(logits_TxE, axis=-1) ** 2), num_tokens,
                        token_axes)
  return Routing(expert_TxK.astype(jnp.int32), gate_TxK, counts_E, balance_loss, z_loss)
