"""Single-device dense reference: every token through its top-k experts, weighted.

No capacity, no exchange, no layout: expert weights in canonical (expert-id)
order. The sharded layer must equal this whenever it drops nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.model.moe.route import route


def moe_reference(params: dict, x_BxQxD: jax.Array, top_k: int, normalize_top_k: bool = True,
                  bias_E: jax.Array | None = None, keep_TxK: jax.Array | None = None,
                  **route_kwargs):
  """Returns (y_BxQxD, counts_E, balance_loss, z_loss); `bias_E` and `route_kwargs` (gate,
  route_scale, hosts_ExN, device_limit, num_groups, topk_groups) as in `route`; `keep_TxK`
  (bool, optional) drops the choices it marks False (a capacity rule's outcome)."""
  d_model = x_BxQxD.shape[-1]
  x_TxD = x_BxQxD.reshape(-1, d_model).astype(jnp.float32)
  r = route(x_TxD, params["router"], top_k, normalize_top_k=normalize_top_k, bias_E=bias_E,
            seq_len=x_BxQxD.shape[1], **route_kwargs)
  gate_h = jnp.einsum("td,edf->etf", x_TxD, params["w_gate"])
  up_h = jnp.einsum("td,edf->etf", x_TxD, params["w_up"])
  out_ExTxD = jnp.einsum("etf,efd->etd", jax.nn.silu(gate_h) * up_h, params["w_down"])
  picked_TxKxD = jnp.take_along_axis(
      out_ExTxD.transpose(1, 0, 2), r.expert_TxK[:, :, None], axis=1)
  gate_TxK = r.gate_TxK if keep_TxK is None else jnp.where(keep_TxK, r.gate_TxK, 0.0)
  y_TxD = jnp.einsum("tkd,tk->td", picked_TxKxD, gate_TxK)
  return y_TxD.reshape(x_BxQxD.shape), r.counts_E, r.balance_loss, r.z_loss
