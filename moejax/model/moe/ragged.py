"""`ragged` dispatch: each device sends exactly the rows it routes, with `ragged_all_to_all`,
into a receive buffer bounded by a factor of the balanced share (dropless at factor 0).

Every device of the expert axis gathers every source's per-slot counts, so all of them know
each (source, destination, slot) count, the offsets and the drop rule (`kept_rows`) alike;
the rows go out sorted by slot, are grouped by slot on arrival for the grouped SwiGLU, and
come back with the reverse exchange (`ragged_stages` lists the steps). Autodiff goes through
JAX's transpose of `ragged_all_to_all` (a reverse ragged_all_to_all).

XLA:CPU does not implement `ragged_all_to_all`; `check_platform` says so at build time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ConfigError
from moejax.model.moe import chunks, grouping
from moejax.model.moe.experts import grouped_ffn
from pallas_kernels.backend import match_varying

ragged_all_to_all = jax.lax.ragged_all_to_all    # module attribute: the one collective used


def check_platform(platform: str) -> None:
  """`platform` of the mesh's devices; called when the layer is built."""
  if platform == "cpu":
    raise ConfigError("moe.dispatch='ragged' needs jax.lax.ragged_all_to_all, which XLA:CPU "
                      "does not implement; use moe.dispatch = 'dense' on CPU.")


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's contract from all_to_all, for CPU, which lacks the collective:
  the tests and the memory benchmark swap it in for `ragged_all_to_all` (O(N x rows) memory).
  The sender zero-pads its N chunks (send_sizes), the receiver places them by the offsets
  the senders chose (all_to_all of output_offsets) and its own recv_sizes, so inconsistent
  sizes or offsets corrupt the result."""
  rows, d = operand.shape
  r = jnp.arange(rows)
  src_NxR = jnp.clip(input_offsets[:, None] + r[None, :], 0, rows - 1)
  chunks = jnp.where((r[None, :] < send_sizes[:, None])[..., None], operand[src_NxR], 0)
  got = jax.lax.all_to_all(chunks, axis_name, 0, 0)                  # [source, rows, D]
  offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dst = jnp.where(r[None, :] < recv_sizes[:, None], offsets[:, None] + r[None, :],
                  output.shape[0])
  return output.at[dst.reshape(-1)].set(got.reshape(-1, d), mode="drop")


def _zeros_like_rows(x_rowsxD, rows):
  """The output buffer of ragged_all_to_all, varying over the same mesh axes as `x` (the
  result takes the buffer's type; a replicated buffer would make autodiff psum the rows)."""
  return match_varying(x_rowsxD, jnp.zeros((rows, x_rowsxD.shape[1]), x_rowsxD.dtype))[1]


def exclusive_cumsum(x, axis=0):
  return jnp.cumsum(x, axis=axis) - x


def kept_rows(counts_NxNxC: jax.Array, rows: int) -> jax.Array:
  """[src, dst, C] choices each source's buffer space on each destination holds: a
  destination's `rows` fill source by source, and a source's block slot by slot."""
  sent_NxN = jnp.sum(counts_NxNxC, axis=2)
  room_NxN = jnp.clip(rows - exclusive_cumsum(sent_NxN, axis=0), 0, sent_NxN)
  return jnp.clip(room_NxN[..., None] - exclusive_cumsum(counts_NxNxC, axis=2), 0,
                  counts_NxNxC)


def ragged_moe(x_TxD, slot_TK, gate_TxK, weights, ops, num_dev: int, slots: int, dtype,
               rows: int):
  """`ragged_stages` run as one piece."""
  return chunks.whole(ragged_stages(x_TxD, slot_TK, gate_TxK, weights, ops, num_dev, slots,
                                    dtype, rows))


def ragged_stages(x_TxD, slot_TK, gate_TxK, weights, ops, num_dev: int, slots: int, dtype,
                  rows: int):
  """Stages (moejax.model.moe.chunks.whole) of (y_TxD float32, slot_counts_S, dropped, kept_S)
  for one device; `weights` = slot-ordered
  (w_gate, w_up, w_down) of this device's C slots (F possibly sharded over 'model', so `y`
  holds partial sums); `rows` the receive buffer (`capacity.ragged_rows`).

  Inside shard_map, per device of the expert axis (N devices, C slots each, T*K choices):
    1. sort choices by slot (stable); gather their token rows into that order: [T*K, D];
    2. all_gather the [N, C] per-slot counts of every source of the group, so every device
       knows every (source, destination, slot) count and the offsets follow from cumsums;
    3. `ragged_all_to_all` sends device d the rows for its slots, packed source-major into a
       receive buffer of `moe.ragged_buffer_factor` x T*K rows (`capacity.ragged_rows`; factor
       0: N*T*K, the worst case, every source sending all its choices to this device, which
       never drops).
       Drop rule, computed by every device alike from the gathered counts (`kept_rows`): a
       destination's buffer fills source by source in source order, a source's block slot by
       slot, each slot's rows in token order; rows past the end are not sent, and those
       choices add nothing to the combine, like dense drops;
    4. group the received rows by slot, run the grouped SwiGLU (group sizes as data), back;
    5. the reverse `ragged_all_to_all` returns each row to its source in the sorted order;
    6. unpermute-combine by each choice's sorted position, weighted by the gates.
  """
  num_tokens, top_k = gate_TxK.shape
  num_choices = num_tokens * top_k
  me = jax.lax.axis_index("expert")
  order_TK = jnp.argsort(slot_TK, stable=True).astype(jnp.int32)
  sorted_pos_TK = jnp.zeros((num_choices,), jnp.int32).at[order_TK].set(
      jnp.arange(num_choices, dtype=jnp.int32))
  counts_S = jnp.zeros((num_dev * slots,), jnp.int32).at[slot_TK].add(1)
  send_TKxD = ops.permute(x_TxD, order_TK // top_k, sorted_pos_TK.reshape(num_tokens, top_k))

  counts_NxNxC = jax.lax.all_gather(counts_S.reshape(num_dev, slots), "expert")  # [src, dst, C]
  kept_NxNxC = kept_rows(counts_NxNxC, rows)
  sent_NxN = jnp.sum(counts_NxNxC, axis=2)                  # rows source s routes to device d
  kept_NxN = jnp.sum(kept_NxNxC, axis=2)                    # ... of which d has room for
  send_sizes = kept_NxN[me]                                 # what I send to each device
  input_offsets = exclusive_cumsum(sent_NxN[me])            # my block for d in my send buffer
  output_offsets = exclusive_cumsum(kept_NxN, axis=0)[me]   # where it lands on d
  recv_sizes = kept_NxN[:, me]                              # what each source sends me
  recv_offsets = exclusive_cumsum(recv_sizes)               # where it lands here

  recv_rowsxD = yield ragged_all_to_all(
      send_TKxD, _zeros_like_rows(send_TKxD, rows),
      input_offsets, send_sizes, output_offsets, recv_sizes, axis_name="expert")
  kept_NxC = kept_NxNxC[:, me, :]
  g = grouping.group_received(grouping.packed_starts(kept_NxC), kept_NxC, rows)
  out_rowsxD = yield grouped_ffn(recv_rowsxD, g, weights, ops, dtype)
  # Reverse: my received chunk from s (at recv_offsets[s]) goes back to where s sent it from;
  # the rows of dropped choices stay zero in the returned buffer, so they add nothing.
  back_TKxD = yield ragged_all_to_all(
      out_rowsxD, _zeros_like_rows(out_rowsxD, num_choices),
      recv_offsets, recv_sizes, exclusive_cumsum(sent_NxN, axis=1)[:, me], send_sizes,
      axis_name="expert")
  y_TxD = ops.combine(back_TKxD, sorted_pos_TK.reshape(num_tokens, top_k), gate_TxK)
  dropped = jnp.sum(sent_NxN[me] - send_sizes).astype(jnp.int32)
  return y_TxD, counts_S, dropped, kept_NxNxC[me].reshape(-1)
