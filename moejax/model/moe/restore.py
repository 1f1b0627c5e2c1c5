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

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def take_slots(w_LxExinxout: jax.Array, idx_LxS: jax.Array, num_experts: int) -> jax.Array:
  """[L, E, in, out] -> [L, S, in, out]: slot s takes expert idx[l, s]'s weights.

  Its transpose sums each expert's slots (its replicas) as a one-hot contraction over the
  slots. Autodiff's transpose of the gather is a scatter-add into the [L, E, in, out] shards,
  which XLA:GPU runs as an atomic-add kernel: in the Mixtral-8x7B program on compile-only
  H100s it was most of what fsep's layer cost beyond static EP's (decision 0121)."""
  del num_experts
  return jnp.take_along_axis(w_LxExinxout, idx_LxS[:, :, None, None], axis=1)


def _take_slots_fwd(w_LxExinxout, idx_LxS, num_experts):
  return take_slots(w_LxExinxout, idx_LxS, num_experts), idx_LxS


def _take_slots_bwd(num_experts, idx_LxS, g_LxSxinxout):
  onehot_LxSxE = jax.nn.one_hot(idx_LxS, num_experts, dtype=g_LxSxinxout.dtype)
  # exact in fp32: a slot's gradient is copied or summed with its replicas', never rounded
  g_LxExinxout = jnp.einsum("lse,lsio->leio", onehot_LxSxE, g_LxSxinxout,
                            precision=jax.lax.Precision.HIGHEST)
  return g_LxExinxout, None


take_slots.defvjp(_take_slots_fwd, _take_slots_bwd)


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
  send = take_slots(w_LxExinxout, idx, w_LxExinxout.shape[1])               # [L, S, in, out]
  send = send.reshape((layers, num_devices, slots) + send.shape[2:]).astype(dtype or send.dtype)
  recv = jax.lax.all_to_all(send, "expert", 1, 1)                         # [L, N src, C, in, out]
  recv = jnp.moveaxis(recv, 1, f_axis)                                     # Nsrc before F
  shape = list(recv.shape)
  shape[f_axis:f_axis + 2] = [shape[f_axis] * shape[f_axis + 1]]
  return recv.reshape(shape)
