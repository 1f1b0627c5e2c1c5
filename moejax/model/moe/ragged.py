"""Dropless `ragged` dispatch: every choice is sent, exactly, with `ragged_all_to_all`.

Inside shard_map, per device of the expert axis (N devices, C slots each, A = T*K choices):
  1. sort choices by slot (stable); gather their token rows into that order: [A, D];
  2. all_gather the [N, C] per-slot counts of every source of the group, so every device
     knows every (source, destination, slot) count and the offsets follow from cumsums;
  3. `ragged_all_to_all` sends device d exactly the rows for its slots, packed source-major
     into a receive buffer of N*A rows (the worst case: every source sends all its choices
     to this device; nothing is dropped, at the cost of N times the send buffer);
  4. group the received rows by slot, run the grouped SwiGLU (group sizes as data), back;
  5. the reverse `ragged_all_to_all` returns each row to its source in the sorted order;
  6. unpermute-combine by each choice's sorted position, weighted by the gates.
Autodiff goes through JAX's transpose of `ragged_all_to_all` (a reverse ragged_all_to_all).

XLA:CPU does not implement `ragged_all_to_all`; `check_platform` says so at build time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ConfigError
from moejax.model.moe import grouping
from moejax.model.moe.experts import grouped_ffn
from pallas_kernels.backend import match_varying

ragged_all_to_all = jax.lax.ragged_all_to_all    # module attribute: the one collective used


def check_platform(platform: str) -> None:
  """`platform` of the mesh's devices; called when the layer is built."""
  if platform == "cpu":
    raise ConfigError("moe.dispatch='ragged' needs jax.lax.ragged_all_to_all, which XLA:CPU "
                      "does not implement; use moe.dispatch = 'dense' on CPU.")


def _zeros_like_rows(x_UxD, rows):
  """The output buffer of ragged_all_to_all, varying over the same mesh axes as `x` (the
  result takes the buffer's type; a replicated buffer would make autodiff psum the rows)."""
  return match_varying(x_UxD, jnp.zeros((rows, x_UxD.shape[1]), x_UxD.dtype))[1]


def exclusive_cumsum(x, axis=0):
  return jnp.cumsum(x, axis=axis) - x


def ragged_moe(x_TxD, slot_A, gate_TxK, weights, ops, num_dev: int, slots: int, dtype):
  """(y_TxD float32, slot_counts_S) for one device; `weights` = slot-ordered (w_gate, w_up,
  w_down) of this device's C slots (F possibly sharded over 'model')."""
  num_tokens, top_k = gate_TxK.shape
  num_choices = num_tokens * top_k
  me = jax.lax.axis_index("expert")
  order_A = jnp.argsort(slot_A, stable=True).astype(jnp.int32)
  sorted_pos_A = jnp.zeros((num_choices,), jnp.int32).at[order_A].set(
      jnp.arange(num_choices, dtype=jnp.int32))
  counts_S = jnp.zeros((num_dev * slots,), jnp.int32).at[slot_A].add(1)
  send_AxD = ops.permute(x_TxD, order_A // top_k, sorted_pos_A.reshape(num_tokens, top_k))

  counts_NxNxC = jax.lax.all_gather(counts_S.reshape(num_dev, slots), "expert")  # [src, dst, C]
  sent_NxN = jnp.sum(counts_NxNxC, axis=2)                  # rows source s sends device d
  send_sizes = sent_NxN[me]                                 # what I send to each device
  input_offsets = exclusive_cumsum(send_sizes)              # my chunk for d in my send buffer
  output_offsets = exclusive_cumsum(sent_NxN, axis=0)[me]   # where it lands on d
  recv_sizes = sent_NxN[:, me]                              # what each source sends me
  recv_offsets = exclusive_cumsum(recv_sizes)               # where it lands here

  recv_UxD = ragged_all_to_all(
      send_AxD, _zeros_like_rows(send_AxD, num_dev * num_choices),
      input_offsets, send_sizes, output_offsets, recv_sizes, axis_name="expert")
  counts_NxC = counts_NxNxC[:, me, :]
  g = grouping.group_received(grouping.packed_starts(counts_NxC), counts_NxC,
                              num_dev * num_choices)
  out_UxD = grouped_ffn(recv_UxD, g, weights, ops, dtype)
  # Reverse: my received chunk from s (at recv_offsets[s]) goes back to where s sent it from.
  back_AxD = ragged_all_to_all(
      out_UxD, _zeros_like_rows(out_UxD, num_choices),
      recv_offsets, recv_sizes, exclusive_cumsum(sent_NxN, axis=1)[:, me], send_sizes,
      axis_name="expert")
  y_TxD = ops.combine(back_AxD, sorted_pos_A.reshape(num_tokens, top_k), gate_TxK)
  return y_TxD, counts_S
