"""Dispatch: map (token, k) choices to slots, pack fixed-capacity buffers, exchange.

`dense` dispatch gives every (source device, destination slot) pair a fixed
capacity. Choices are ordered by slot (stable, so earlier tokens win) and the
ones beyond the capacity are dropped and counted. All index work is int32 and
carries no gradient; only the row gathers of activations are differentiated, and their
backward gathers too (`permute_rows`): autodiff of a gather is a scatter-add, whose atomic
adds ran at a quarter of a gather's bytes/s on an H200 (moejax.strategy.hardware).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moejax.layout import capacity as capacity_lib
from moejax.model.moe import kept_exchange
from pallas_kernels import compat

EXCHANGED = "moe_exchanged"     # the name of an exchange's output, for remat policies


class BufferIndex(NamedTuple):
  """Where each choice goes in the send buffer [S*cap rows] and which token fills each row."""
  buf_index_TK: jax.Array     # int32 [T*K]: row of the send buffer, or -1 if dropped
  buf_token_rows: jax.Array     # int32 [U = S*cap]: token that fills each buffer row, or T if empty
  dropped: jax.Array         # int32 scalar: choices dropped on this device
  slot_counts_S: jax.Array   # int32 [S]: choices this device sent to each slot (before drops)


def capacity(num_tokens: int, top_k: int, num_slots: int, capacity_factor: float) -> int:
  """Rows per (source, slot): capacity_factor times the balanced share, at least 1."""
  return capacity_lib.rows("slot", num_tokens, top_k, num_slots, 1, capacity_factor)


def buffer_index(slot_TK: jax.Array, top_k: int, num_slots: int, cap: int,
                 slots_per_buffer: int = 1) -> BufferIndex:
  """Orders the choices by slot (stable: earlier tokens win) into `cap` rows per buffer; a
  buffer holds `slots_per_buffer` consecutive slots (1: per-slot capacity; C: pooled per
  device, where a device's lower slots fill first)."""
  num_choices = slot_TK.shape[0]
  order_TK = jnp.argsort(slot_TK, stable=True)
  counts_S = jnp.zeros((num_slots,), jnp.int32).at[slot_TK].add(1)
  counts_bufs = counts_S.reshape(-1, slots_per_buffer).sum(axis=1)
  starts_bufs = jnp.cumsum(counts_bufs) - counts_bufs
  buffer_TK = slot_TK // slots_per_buffer
  pos_sorted_TK = jnp.arange(num_choices, dtype=jnp.int32) - starts_bufs[buffer_TK[order_TK]]
  pos_TK = jnp.zeros((num_choices,), jnp.int32).at[order_TK].set(pos_sorted_TK)
  keep_TK = pos_TK < cap
  buf_index_TK = jnp.where(keep_TK, buffer_TK * cap + pos_TK, -1)

  pos_rows = jnp.arange(cap, dtype=jnp.int32)
  filled_bufsxrows = pos_rows[None, :] < counts_bufs[:, None]
  src_bufsxrows = jnp.clip(starts_bufs[:, None] + pos_rows[None, :], 0, num_choices - 1)
  num_tokens = num_choices // top_k
  buf_token_bufsxrows = jnp.where(filled_bufsxrows, order_TK[src_bufsxrows] // top_k, num_tokens)
  dropped = jnp.sum(~keep_TK).astype(jnp.int32)
  return BufferIndex(buf_index_TK.astype(jnp.int32), buf_token_bufsxrows.reshape(-1), dropped,
                     counts_S)


def gather_rows(x_TxD: jax.Array, token_rows: jax.Array) -> jax.Array:
  """out[u] = x[token_rows[u]], zeros where token_rows[u] is outside [0, T) (XLA gather)."""
  num_tokens = x_TxD.shape[0]
  x_ext = jnp.concatenate([x_TxD, jnp.zeros((1, x_TxD.shape[1]), x_TxD.dtype)], axis=0)
  return x_ext[jnp.where((token_rows >= 0) & (token_rows < num_tokens), token_rows, num_tokens)]


@jax.custom_vjp
def permute_rows(x_TxD: jax.Array, token_rows: jax.Array, rows_TxK: jax.Array) -> jax.Array:
  """`gather_rows(x_TxD, token_rows)`, whose backward gathers: `rows_TxK` is the inverse map
  (the rows token t went to, -1 padded: row u in rows_TxK[t] exactly when token_rows[u] = t),
  so dx[t] = sum_k dout[rows_TxK[t, k]], summed in float32 without a scatter."""
  return gather_rows(x_TxD, token_rows)


def cotangent_of(ct: jax.Array, varies_like: jax.Array) -> jax.Array:
  """`ct` typed as the cotangent of an input that varies like `varies_like` inside a
  `shard_map`: summed over the mesh axes only `ct` varies over (what autodiff's transpose of
  the forward's implicit broadcast does), cast to vary over the ones it lacks."""
  extra = tuple(sorted(compat.varying_axes(ct) - compat.varying_axes(varies_like)))
  if extra:
    ct = jax.lax.psum(ct, extra)
  return compat.mark_varying(ct, compat.varying_axes(varies_like))


def _permute_rows_fwd(x_TxD, token_rows, rows_TxK):
  # a zero-size slice of x: its dtype and varying axes, for the backward's cotangent
  return gather_rows(x_TxD, token_rows), (rows_TxK, x_TxD[:0])


def _permute_rows_bwd(res, dout_rowsxD):
  rows_TxK, like_x = res
  num_rows = dout_rowsxD.shape[0]
  dout_ext = jnp.concatenate([dout_rowsxD, jnp.zeros((1, dout_rowsxD.shape[1]), dout_rowsxD.dtype)])
  picked_TxKxD = dout_ext[jnp.where(rows_TxK >= 0, rows_TxK, num_rows)]
  dx = jnp.sum(picked_TxKxD, axis=1, dtype=jnp.float32).astype(like_x.dtype)
  return cotangent_of(dx, like_x), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def inverse_rows(rows_TxK: jax.Array, num_rows: int) -> jax.Array:
  """int32 [num_rows]: the flat (t * K + k) choice each row holds, T * K where none does, from
  `rows_TxK` (each row held by at most one choice; -1: the choice has no row)."""
  flat = rows_TxK.reshape(-1)
  choice = jnp.full((num_rows + 1,), flat.shape[0], jnp.int32)
  return choice.at[jnp.where(flat >= 0, flat, num_rows)].set(
      jnp.arange(flat.shape[0], dtype=jnp.int32), mode="drop")[:num_rows]


def pack(x_TxD: jax.Array, index: BufferIndex) -> jax.Array:
  """Send buffer [U = S*cap, D]; empty rows are zeros."""
  top_k = index.buf_index_TK.shape[0] // x_TxD.shape[0]
  return permute_rows(x_TxD, index.buf_token_rows,
                      index.buf_index_TK.reshape(x_TxD.shape[0], top_k))


def _all_to_all_rows(buf_rowsxD: jax.Array, num_devices: int, axis_name: str) -> jax.Array:
  rows, d = buf_rowsxD.shape
  x_NxrowsxD = buf_rowsxD.reshape(num_devices, rows // num_devices, d)
  return jax.lax.all_to_all(x_NxrowsxD, axis_name, 0, 0).reshape(rows, d)


def _exchange_transpose(num_devices: int, axis_name: str, ct_rowsxD: jax.Array,
                        like_buf: jax.Array) -> jax.Array:
  # a kept value may vary over mesh axes the exchanged buffer did not (it came in through a
  # shard_map's in_specs): cotangent_of sums over those, as autodiff of that broadcast would
  return cotangent_of(_all_to_all_rows(ct_rowsxD, num_devices, axis_name), like_buf)


def exchange(buf_rowsxD: jax.Array, num_devices: int, axis_name: str) -> jax.Array:
  """all_to_all over the expert axis. Row block d of the input goes to device d;
  row block s of the output came from device s. The same call reverses itself.
  Under a replaying `kept_exchange` tape it returns the forward's value instead, its
  transpose unchanged; under a recording one it records its value."""
  tape = kept_exchange.current()
  if tape is not None and tape.replaying:
    return kept_exchange.replayed(buf_rowsxD, tape.next_kept(),
                                  partial(_exchange_transpose, num_devices, axis_name))
  # named for a remat policy that keeps it (model.remat_keeps_exchange); no-op otherwise
  y = checkpoint_name(_all_to_all_rows(buf_rowsxD, num_devices, axis_name), EXCHANGED)
  return y if tape is None else tape.record(y)


def exchange_counts(kept_S: jax.Array, num_devices: int, axis_name: str) -> jax.Array:
  """[S] rows this device kept for each slot -> [sources, C]: the rows each source kept for
  each of this device's C slots (what a grouped matmul over the received rows needs). Named
  and taped like the rows' exchange, so that what keeps one keeps both."""
  tape = kept_exchange.current()
  if tape is not None and tape.replaying:
    return tape.next_kept()            # integer counts: no cotangent
  slots = kept_S.shape[0] // num_devices
  got = checkpoint_name(jax.lax.all_to_all(kept_S.reshape(num_devices, slots), axis_name, 0, 0),
                        EXCHANGED)
  return got if tape is None else tape.record(got)


def to_slot_major(recv_rowsxD: jax.Array, num_devices: int, slots: int) -> jax.Array:
  """[N*C*cap, D] (source-major) -> [C, N*cap, D] for per-slot matmuls."""
  rows, d = recv_rowsxD.shape
  cap = rows // (num_devices * slots)
  x = recv_rowsxD.reshape(num_devices, slots, cap, d).transpose(1, 0, 2, 3)
  return x.reshape(slots, num_devices * cap, d)


def from_slot_major(y_CxrowsxD: jax.Array, num_devices: int) -> jax.Array:
  """Inverse of `to_slot_major`: [C, N*cap, D] -> [N*C*cap, D]."""
  slots, rows, d = y_CxrowsxD.shape
  cap = rows // num_devices
  y = y_CxrowsxD.reshape(slots, num_devices, cap, d).transpose(1, 0, 2, 3)
  return y.reshape(num_devices * slots * cap, d)
