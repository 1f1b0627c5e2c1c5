"""Received rows -> slot-contiguous groups for a grouped matmul, and back.

After the exchange a device holds its slots' rows source-major: the rows that source s sent to
local slot c start at `starts_NxC[s, c]` and number `counts_NxC[s, c]` (the dense dispatch:
fixed `cap`-row blocks with empty rows between; the ragged one: packed chunks). A grouped
matmul wants them slot-major and packed: slot c's rows (sources in order) form group c of
`sizes_C[c]` rows, and the buffer ends with the unused rows. Both directions are row
permutations: `recv_row` (grouped row -> received row, -1 for the unused tail) and
`group_row` (received row -> grouped row, -1 for empty rows), each the other's inverse, so
one permute op (and its transpose) moves rows either way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Grouping(NamedTuple):
  recv_row: jax.Array      # int32 [rows]: received row feeding each grouped row, or -1
  group_row: jax.Array     # int32 [rows]: grouped row of each received row, or -1
  sizes_C: jax.Array         # int32 [C]: rows per local slot (group sizes of the matmul)


def group_received(starts_NxC: jax.Array, counts_NxC: jax.Array, rows: int, align: int = 1,
                   out_rows: int | None = None) -> Grouping:
  """`starts_NxC` must be non-decreasing in (source, slot) order, blocks not overlapping.
  `align`: each group starts at a multiple of it (tiled matmuls); `out_rows`: length of the
  grouped buffer (default `rows`; with align > 1 it must hold the padded groups)."""
  out_rows = rows if out_rows is None else out_rows
  num_src, slots = counts_NxC.shape
  block_starts, block_counts = starts_NxC.reshape(-1), counts_NxC.reshape(-1)   # [N*C]
  r = jnp.arange(rows, dtype=jnp.int32)
  f = jnp.searchsorted(block_starts, r, side="right").astype(jnp.int32) - 1  # block of row r
  f_safe = jnp.maximum(f, 0)
  pos = r - block_starts[f_safe]
  valid = (f >= 0) & (pos < block_counts[f_safe])
  sizes_C = jnp.sum(counts_NxC, axis=0)
  padded_C = -(-sizes_C // align) * align
  group_start_C = jnp.cumsum(padded_C) - padded_C
  before_NxC = jnp.cumsum(counts_NxC, axis=0) - counts_NxC      # earlier sources, same slot
  q = (group_start_C[f_safe % slots] + before_NxC.reshape(-1)[f_safe] + pos).astype(jnp.int32)
  group_row = jnp.where(valid, q, -1)
  recv_row = jnp.full((out_rows,), -1, jnp.int32).at[jnp.where(valid, q, out_rows)].set(
      r, mode="drop")
  return Grouping(recv_row, group_row, sizes_C.astype(jnp.int32))


def dense_starts(num_src: int, slots: int, cap: int) -> jax.Array:
  """Block starts of the dense dispatch's received buffer [sources, C, cap]."""
  return (jnp.arange(num_src * slots, dtype=jnp.int32) * cap).reshape(num_src, slots)


def packed_starts(counts_NxC: jax.Array) -> jax.Array:
  """Block starts when the blocks are packed back to back from row 0 (ragged receive)."""
  flat = counts_NxC.reshape(-1)
  return (jnp.cumsum(flat) - flat).reshape(counts_NxC.shape).astype(jnp.int32)
