"""FSEP restore: every device rebuilds the full weights of the experts its slots host.

Expert weights live as `[layers, E, ..., F]` with F sharded over the (expert, model)
axes (1/(N * model-axis size) per device). A device gathers, for every slot of the group, its own
F-shard of that slot's expert, and one equal-size all_to_all over the expert
axis hands each device the N shards of its C slots. The result is slot-ordered
weights sharded like `ep` weights ([layers, N*C, ..., F / model-axis size] per device). Its
transpose (autodiff) sends gradient shards back to their owners and sums the
gradients of an expert's replicas. The restored F order is a fixed permutation
of the original (source-major chunks), the same for w_gate/w_up (columns) and
w_down (rows), so the SwiGLU is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def restore_local(w_LxExinxout: jax.Array, slot_expert_LxS: jax.Array, num_devices: int,
                  f_axis: int, dtype=None) -> jax.Array:
  """Inside shard_map: [L, E, in, out] local shards -> [L, C, in, out*N] or [L, C, in*N, out].

  `f_axis` (2 or 3) is the sharded FFN axis of the weight (3 for w_gate/w_up, 2 for w_down).
  `dtype` (default: the shards' own): the restored weights' dtype. The cast comes before the
  all_to_all, so the exchange, and its transpose carrying the gradient home, move compute-dtype
  bytes while the stored shards stay fp32.
  """
  layers, num_slots = slot_expert_LxS.shape
  slots = num_slots // num_devices
  idx = jnp.maximum(slot_expert_LxS, 0)
  send = jnp.take_along_axis(w_LxExinxout, idx[:, :, None, None], axis=1)   # [L, S, in, out]
  send = send.reshape((layers, num_devices, slots) + send.shape[2:]).astype(dtype or send.dtype)
  recv = jax.lax.all_to_all(send, "expert", 1, 1)                         # [L, N src, C, in, out]
  recv = jnp.moveaxis(recv, 1, f_axis)                                     # Nsrc before F
  shape = list(recv.shape)
  shape[f_axis:f_axis + 2] = [shape[f_axis] * shape[f_axis + 1]]
  return recv.reshape(shape)
