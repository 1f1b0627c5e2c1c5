"""The pooled layer's grouped expert SwiGLU with the XLA kernels (`moe.kernels = 'xla'`),
from static tiles.

`jax.lax.ragged_dot` on XLA:CPU costs about one dense matmul per group over all rows. Here
each group is padded to a multiple of `tile` rows inside a buffer of a bounded number of
tiles, and a `lax.scan` over the tiles runs each through its group's gate, up and down
weights (dynamic indexes into the stacked weights), so the matmuls and the activation cost
what the used tiles hold, not G times the rows; tiles past the groups are skipped. The
backward is a `custom_vjp` scan too: dx with the weights transposed, dW the per-tile products
summed by group (accumulated in the scan).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import compat
from pallas_kernels.backend import match_varying

MAX_TILE = 512                 # XLA:CPU's; a GPU's tiles are bounded by the share instead
MIN_TILE = 32
# XLA:GPU: what one tile costs besides its rows' matmuls, in rows of that work. Each scan step
# is a loop iteration the host launches (55 us on the H200, moejax.strategy.hardware) and
# moves its group's weights (a slice of each for the matmuls; in the backward the f32
# gradient sums read and written). The schedule estimate of the pooled program at
# power-of-two tiles puts it at 230-910 rows on Mixtral-8x7B's shape and above 820 on the GPU
# config's, whose d_model x d_ff is smaller beside the same launch (docs/decisions/0134).
GPU_TILE_COST_ROWS = 512


def tile_rows(rows: int, groups: int, platform: str = "cpu") -> int:
  """Tile height for `rows` rows in `groups` groups on `platform`: a power of two, at least
  MIN_TILE and no more than the power of two covering one group's even share. Each group's
  last tile is on average half padding, so groups * tile / 2 rows are wasted, against the
  fixed cost of each tile.

  XLA:CPU: the power of two nearest an eighth of the share, at most MAX_TILE: the waste near
  1/16 of the buffer, tiles large enough for the matmuls and few enough for the scan
  (docs/decisions/0103). Nearest in log scale: the power below halves the tile, and doubles
  the scan's steps, for every share just under 8 x a power of two (1022 rows: 64, where 1024
  gets 128; docs/decisions/0133).

  XLA:GPU: per group, share / tile tiles each cost GPU_TILE_COST_ROWS rows and the padding
  costs tile / 2; share x GPU_TILE_COST_ROWS / tile + tile / 2 is least at
  sqrt(2 x share x GPU_TILE_COST_ROWS), taken to the log-nearest power of two; at most half
  the share (above MIN_TILE), so that a buffer of tiles (and the products the backward keeps)
  holds at most 1.5x the rows: the memory model does not count the padding
  (docs/decisions/0134)."""
  share = max(1, -(-rows // groups))
  cover = 1 << (share - 1).bit_length()
  if compat.is_nvidia_gpu(platform):
    target = math.sqrt(2.0 * share * GPU_TILE_COST_ROWS)
    cap = 1 << max(0, (share // 2).bit_length() - 1)      # the power of two <= share / 2
  else:
    target, cap = share / 8, MAX_TILE
  nearest = 1 << max(0, round(math.log2(max(1.0, target))))
  return min(cover, max(MIN_TILE, min(nearest, cap)))


def num_tiles(rows: int, groups: int, tile: int) -> int:
  """Tiles that hold `rows` rows in `groups` groups, each padded to a multiple of `tile`."""
  return (rows + groups * (tile - 1)) // tile


def tile_groups(sizes_C: jax.Array, tiles: int, tile: int) -> jax.Array:
  """int32 [tiles]: the group each tile belongs to, -1 for the unused tail tiles (the SwiGLU
  skips them and gives zeros)."""
  end_C = jnp.cumsum(-(-sizes_C // tile))
  t = jnp.arange(tiles, dtype=jnp.int32)
  group = jnp.searchsorted(end_C, t, side="right").astype(jnp.int32)
  return jnp.where(group < sizes_C.shape[0], group, -1)


def tiled_swiglu(x_rowsxD: jax.Array, w_gate_CxDxffn: jax.Array, w_up_CxDxffn: jax.Array,
                 w_down_CxffnxD: jax.Array, group_of_tile: jax.Array, tile: int,
                 dtype=jnp.float32) -> jax.Array:
  """`swiglu_grouped` (moejax.model.moe.experts) over static tiles, the whole SwiGLU of a tile
  in one scan step: tile i of x through group_of_tile[i]'s gate, up and down weights, zeros
  where that is -1. The activation and its gradient run on the used tiles only: over every
  row of the buffer those elementwise passes cost about as much as the matmuls on XLA:CPU
  (docs/decisions/0103). The backward is one scan too: per tile dx and the three weights'
  gradients (f32 sums by group), from the gate and up products the forward kept."""
  args = match_varying(x_rowsxD.astype(dtype), w_gate_CxDxffn.astype(dtype),
                       w_up_CxDxffn.astype(dtype), w_down_CxffnxD.astype(dtype))
  return _tiled_swiglu(*args, group_of_tile, tile)


def _swiglu_tiles(x_rowsxD, w_gate, w_up, w_down, group_of_tile, tile, keep):
  """(y [rows, D], and with `keep` the gate and up products [tiles, tile, ffn])."""
  rows, width = x_rowsxD.shape
  ffn = w_gate.shape[-1]
  x_tiles = x_rowsxD.reshape(rows // tile, tile, width)

  def body(carry, xs):
    x_t, g = xs

    def run():
      i = jnp.maximum(g, 0)
      a_t, u_t = jnp.dot(x_t, w_gate[i]), jnp.dot(x_t, w_up[i])
      return (jnp.dot(jax.nn.silu(a_t) * u_t, w_down[i]),) + ((a_t, u_t) if keep else ())

    def skip():
      zeros = lambda *shape: match_varying(jnp.zeros(shape, x_t.dtype), x_t)[0]
      return (zeros(tile, w_down.shape[-1]),) + ((zeros(tile, ffn),) * 2 if keep else ())

    return carry, jax.lax.cond(g >= 0, run, skip)

  _, out = jax.lax.scan(body, None, (x_tiles, group_of_tile))
  return (out[0].reshape(rows, -1),) + tuple(out[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _tiled_swiglu(x_rowsxD, w_gate, w_up, w_down, group_of_tile, tile):
  return _swiglu_tiles(x_rowsxD, w_gate, w_up, w_down, group_of_tile, tile, False)[0]


def _swiglu_fwd(x_rowsxD, w_gate, w_up, w_down, group_of_tile, tile):
  y, a_tiles, u_tiles = _swiglu_tiles(x_rowsxD, w_gate, w_up, w_down, group_of_tile, tile, True)
  return y, (x_rowsxD, w_gate, w_up, w_down, group_of_tile, a_tiles, u_tiles)


def _swiglu_bwd(tile, res, dy_rowsxD):
  x_rowsxD, w_gate, w_up, w_down, group_of_tile, a_tiles, u_tiles = res
  rows, width = x_rowsxD.shape
  x_tiles = x_rowsxD.reshape(rows // tile, tile, width)
  dy_tiles = dy_rowsxD.reshape(rows // tile, tile, -1)
  f32 = jnp.float32
  outer = lambda a, b: jnp.dot(a.T, b, preferred_element_type=f32)

  # The cond returns the tile's weight gradients and the loop body adds them into the carried
  # f32 sums after it: sums passed through the cond are copied whole every tile on XLA:GPU
  # (each its weight's size), where the slice add in the loop body updates them in place
  # (docs/decisions/0133).
  def body(dw, xs):
    x_t, a_t, u_t, dy_t, g = xs
    i = jnp.maximum(g, 0)

    def run():
      sig_t = jax.nn.sigmoid(a_t)
      silu_t = a_t * sig_t
      dh_t = jnp.dot(dy_t, w_down[i].T)
      du_t = dh_t * silu_t
      da_t = dh_t * u_t * (sig_t * (1 + a_t * (1 - sig_t)))
      dx_t = jnp.dot(da_t, w_gate[i].T) + jnp.dot(du_t, w_up[i].T)
      return (outer(x_t, da_t), outer(x_t, du_t), outer(silu_t * u_t, dy_t)), dx_t

    def skip():
      zeros = tuple(match_varying(jnp.zeros(d.shape[1:], f32), d)[0] for d in dw)
      return zeros, match_varying(jnp.zeros((tile, width), x_t.dtype), x_t)[0]

    parts, dx_t = jax.lax.cond(g >= 0, run, skip)
    return tuple(d.at[i].add(p) for d, p in zip(dw, parts)), dx_t

  # f32 sums
  dw0 = tuple(match_varying(jnp.zeros(w.shape, f32), x_rowsxD, dy_rowsxD)[0]
              for w in (w_gate, w_up, w_down))
  dw, dx_tiles = jax.lax.scan(body, dw0, (x_tiles, a_tiles, u_tiles, dy_tiles, group_of_tile))
  return ((dx_tiles.reshape(rows, width).astype(x_rowsxD.dtype),)
          + tuple(d.astype(w.dtype) for d, w in zip(dw, (w_gate, w_up, w_down))) + (None,))


_tiled_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
