"""Device-pooled capacity (`moe.capacity = 'device'`): one buffer per (source, device).

Per-slot capacity gives each (source, slot) pair `cap` rows, so a placement cannot move load
between buffers. Pooled capacity gives each (source, destination device) pair
`cap_dev = ceil(cf * T * K / N)` rows, shared by that device's C slots: a device whose slots
are hot and cold together absorbs the hot one's overflow.

Drop rule (deterministic): a source orders its choices by destination device, then by slot
(local slot index on that device), then by token order (stable sort of the slot ids); the
first `cap_dev` choices to each device are kept, the rest dropped. So when a device
overflows, its higher-numbered local slots lose choices first, and within a slot the later
tokens. `pooled_keep` in tests/moe_helpers.py is the same rule in numpy, the tests' oracle.

A block from one source arrives packed slot by slot; the receiver groups the rows by slot
and runs them through a grouped matmul over the pooled N * cap_dev rows: the Pallas gmm
(`moe.kernels = 'pallas'`), or the static-tile scan of `moejax.model.moe.tiled` (XLA).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.layout import capacity as capacity_lib
from moejax.model.moe import dispatch as dispatch_lib, grouping, tiled
from moejax.model.moe.dispatch import BufferIndex
from moejax.model.moe.experts import grouped_ffn


def device_capacity(num_tokens: int, top_k: int, num_devices: int,
                    capacity_factor: float) -> int:
  """Rows per (source, device): capacity_factor times the balanced share, at least 1."""
  return capacity_lib.rows("device", num_tokens, top_k, num_devices, 1, capacity_factor)


class PooledIndex(NamedTuple):
  index: BufferIndex         # rows: [N * cap_dev], device d's block packed slot by slot
  kept_S: jax.Array          # int32 [S]: choices to each slot that the buffer kept


def pooled_index(slot_TK: jax.Array, top_k: int, num_devices: int, slots: int,
                 cap_dev: int) -> PooledIndex:
  """Send-buffer rows for this source's choices under the drop rule in the module doc."""
  index = dispatch_lib.buffer_index(slot_TK, top_k, num_devices * slots, cap_dev, slots)
  counts_NxC = index.slot_counts_S.reshape(num_devices, slots)
  within_NxC = jnp.cumsum(counts_NxC, axis=1) - counts_NxC     # earlier slots, same device
  kept_NxC = jnp.clip(cap_dev - within_NxC, 0, counts_NxC)
  return PooledIndex(index, kept_NxC.reshape(-1).astype(jnp.int32))


def pooled_starts(kept_NxC: jax.Array, cap_dev: int) -> jax.Array:
  """Block starts in the received buffer [sources, cap_dev]: each source's block holds its
  slots' kept rows back to back."""
  num_src = kept_NxC.shape[0]
  within_NxC = jnp.cumsum(kept_NxC, axis=1) - kept_NxC
  return (jnp.arange(num_src, dtype=jnp.int32)[:, None] * cap_dev + within_NxC).astype(
      jnp.int32)


def _tiled_ffn(recv_rowsxD, starts_NxC, kept_NxC, weights, ops, dtype):
  """`grouped_ffn` with slot groups padded to whole tiles and the static-tile SwiGLU, which
  runs the whole FFN of a tile in one step and skips the tiles no group uses."""
  rows = recv_rowsxD.shape[0]
  slots = kept_NxC.shape[1]
  tile = tiled.tile_rows(rows, slots, ops.platform)
  tiles = tiled.num_tiles(rows, slots, tile)
  g = grouping.group_received(starts_NxC, kept_NxC, rows, align=tile, out_rows=tiles * tile)
  group_of_tile = tiled.tile_groups(g.sizes_C, tiles, tile)
  x_rowsxD = ops.permute(recv_rowsxD, g.recv_row, g.group_row[:, None])
  y_rowsxD = tiled.tiled_swiglu(x_rowsxD, *weights, group_of_tile, tile, dtype)
  return ops.permute(y_rowsxD, g.group_row, g.recv_row[:, None])


def pooled_dispatch_combine(x_TxD, slot_TK, gate_TxK, weights, ops, num_dev, slots, cap_dev,
                            dtype):
  """Pooled dispatch -> grouped experts -> combine on one device, as stages
  (moejax.model.moe.chunks.whole) of (y_TxD, dropped, slot_counts_S, kept_S)."""
  p = pooled_index(slot_TK, gate_TxK.shape[1], num_dev, slots, cap_dev)
  row_TxK = p.index.buf_index_TK.reshape(gate_TxK.shape)
  recv = dispatch_lib.exchange(ops.permute(x_TxD, p.index.buf_token_rows, row_TxK), num_dev,
                               "expert")
  recv = yield recv
  # Rows each source kept for each of my slots: [sources, C].
  kept_NxC = dispatch_lib.exchange_counts(p.kept_S, num_dev, "expert")
  starts_NxC = pooled_starts(kept_NxC, cap_dev)
  if ops.name == "xla":
    out = _tiled_ffn(recv, starts_NxC, kept_NxC, weights, ops, dtype)
  else:
    out = grouped_ffn(recv, grouping.group_received(starts_NxC, kept_NxC, recv.shape[0]),
                      weights, ops, dtype)
  out = yield out
  back = yield dispatch_lib.exchange(out, num_dev, "expert")
  return ops.combine(back, row_TxK, gate_TxK), p.index.dropped, p.index.slot_counts_S, p.kept_S
