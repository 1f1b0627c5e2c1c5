"""Dispatch: map (token, k) choices to slots, pack fixed-capacity buffers, exchange.

`dense` dispatch gives every (source device, destination slot) pair a fixed
capacity. Choices are ordered by slot (stable, so earlier tokens win) and the
ones beyond the capacity are dropped and counted. All index work is int32 and
carries no gradient; only the row gathers of activations are differentiated.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.layout import capacity as capacity_lib


class BufferIndex(NamedTuple):
  """Where each choice goes in the send buffer [S*cap rows] and which token fills each row."""
  buf_index_A: jax.Array     # int32 [A]: row of the send buffer, or -1 if dropped
  buf_token_U: jax.Array     # int32 [U = S*cap]: token that fills each buffer row, or T if empty
  dropped: jax.Array         # int32 scalar: choices dropped on this device
  slot_counts_S: jax.Array   # int32 [S]: choices this device sent to each slot (before drops)


def capacity(num_tokens: int, top_k: int, num_slots: int, capacity_factor: float) -> int:
  """Rows per (source, slot): capacity_factor times the balanced share, at least 1."""
  return capacity_lib.rows("slot", num_tokens, top_k, num_slots, 1, capacity_factor)


def buffer_index(slot_A: jax.Array, top_k: int, num_slots: int, cap: int,
                 slots_per_buffer: int = 1) -> BufferIndex:
  """Orders the choices by slot (stable: earlier tokens win) into `cap` rows per buffer; a
  buffer holds `slots_per_buffer` consecutive slots (1: per-slot capacity; C: pooled per
  device, where a device's lower slots fill first)."""
  num_choices = slot_A.shape[0]
  order_A = jnp.argsort(slot_A, stable=True)
  counts_S = jnp.zeros((num_slots,), jnp.int32).at[slot_A].add(1)
  counts_B = counts_S.reshape(-1, slots_per_buffer).sum(axis=1)
  starts_B = jnp.cumsum(counts_B) - counts_B
  buffer_A = slot_A // slots_per_buffer
  pos_sorted_A = jnp.arange(num_choices, dtype=jnp.int32) - starts_B[buffer_A[order_A]]
  pos_A = jnp.zeros((num_choices,), jnp.int32).at[order_A].set(pos_sorted_A)
  keep_A = pos_A < cap
  buf_index_A = jnp.where(keep_A, buffer_A * cap + pos_A, -1)

  pos_P = jnp.arange(cap, dtype=jnp.int32)
  filled_BxP = pos_P[None, :] < counts_B[:, None]
  src_BxP = jnp.clip(starts_B[:, None] + pos_P[None, :], 0, num_choices - 1)
  num_tokens = num_choices // top_k
  buf_token_BxP = jnp.where(filled_BxP, order_A[src_BxP] // top_k, num_tokens)
  dropped = jnp.sum(~keep_A).astype(jnp.int32)
  return BufferIndex(buf_index_A.astype(jnp.int32), buf_token_BxP.reshape(-1), dropped,
                     counts_S)


def gather_rows(x_TxD: jax.Array, token_U: jax.Array) -> jax.Array:
  """out[u] = x[token_U[u]], zeros where token_U[u] is outside [0, T) (XLA gather)."""
  num_tokens = x_TxD.shape[0]
  x_ext = jnp.concatenate([x_TxD, jnp.zeros((1, x_TxD.shape[1]), x_TxD.dtype)], axis=0)
  return x_ext[jnp.where((token_U >= 0) & (token_U < num_tokens), token_U, num_tokens)]


def pack(x_TxD: jax.Array, index: BufferIndex) -> jax.Array:
  """Send buffer [U = S*cap, D]; empty rows are zeros."""
  return gather_rows(x_TxD, index.buf_token_U)


def exchange(buf_UxD: jax.Array, num_devices: int, axis_name: str) -> jax.Array:
  """all_to_all over the expert axis. Row block d of the input goes to device d;
  row block s of the output came from device s. The same call reverses itself."""
  rows, d = buf_UxD.shape
  x_NxUxD = buf_UxD.reshape(num_devices, rows // num_devices, d)
  y_NxUxD = jax.lax.all_to_all(x_NxUxD, axis_name, 0, 0)
  return y_NxUxD.reshape(rows, d)


def to_slot_major(recv_UxD: jax.Array, num_devices: int, slots: int) -> jax.Array:
  """[N*C*cap, D] (source-major) -> [C, N*cap, D] for per-slot matmuls."""
  rows, d = recv_UxD.shape
  cap = rows // (num_devices * slots)
  x = recv_UxD.reshape(num_devices, slots, cap, d).transpose(1, 0, 2, 3)
  return x.reshape(slots, num_devices * cap, d)


def from_slot_major(y_CxUxD: jax.Array, num_devices: int) -> jax.Array:
  """Inverse of `to_slot_major`: [C, N*cap, D] -> [N*C*cap, D]."""
  slots, rows, d = y_CxUxD.shape
  cap = rows // num_devices
  y = y_CxUxD.reshape(slots, num_devices, cap, d).transpose(1, 0, 2, 3)
  return y.reshape(num_devices * slots * cap, d)
