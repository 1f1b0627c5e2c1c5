"""Public grouped matmul `gmm` (custom_vjp) and `tgmm`; kernels in gmm.py / gmm_mosaic.py.

    gmm(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]: row block g times w[g]
    tgmm(x [M, K], dy [M, N], group_sizes [G]) -> [G, K, N]: per-group x^T dy

Group sizes are data (int32, any values >= 0; their running sum is clipped to M); rows past
the last group give zeros. Gradients: dx = gmm(dy, w^T), dw = tgmm(x, dy); none for sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backend_lib, gmm_mosaic
from pallas_kernels.gmm import GmmTuning, gmm_call, gmm_reference, tgmm_call, tgmm_reference

__all__ = ["GmmTuning", "gmm", "gmm_reference", "tgmm", "tgmm_reference"]

DEFAULT_TUNING = GmmTuning()


def _check(x_MxK, w_GxKxN, group_sizes_G, tuning):
  if x_MxK.ndim != 2 or w_GxKxN.ndim != 3:
    raise ValueError(f"gmm: x {x_MxK.shape} and w {w_GxKxN.shape} must be [M, K] and "
                     "[G, K, N].")
  if w_GxKxN.shape[1] != x_MxK.shape[1]:
    raise ValueError(f"gmm: x has K={x_MxK.shape[1]} columns but w {w_GxKxN.shape} has "
                     f"K={w_GxKxN.shape[1]}; they must match.")
  if group_sizes_G.shape != (w_GxKxN.shape[0],) or not jnp.issubdtype(group_sizes_G.dtype,
                                                                       jnp.integer):
    raise ValueError(f"gmm: group_sizes is {group_sizes_G.dtype}{list(group_sizes_G.shape)}; "
                     f"it must be integer [G={w_GxKxN.shape[0]}].")
  if x_MxK.dtype != w_GxKxN.dtype:
    raise ValueError(f"gmm: x is {x_MxK.dtype} but w is {w_GxKxN.dtype}; cast both to the "
                     "compute dtype.")
  backend_lib.check_pow2("GmmTuning.block_m", tuning.block_m)


def _gmm(x, w, sizes, tuning, transpose_rhs):
  backend = backend_lib.resolve(tuning.backend)
  if backend == "mosaic_gpu":
    return gmm_mosaic.ragged_dot(x, w, sizes, tuning, transpose_rhs)
  return gmm_call(x, w, sizes, tuning, backend, transpose_rhs)


def _tgmm(x, dy, sizes, tuning, out_dtype):
  backend = backend_lib.resolve(tuning.backend)
  if backend == "mosaic_gpu":
    return gmm_mosaic.transposed_ragged_dot(x, dy, sizes, tuning).astype(out_dtype)
  return tgmm_call(x, dy, sizes, tuning, backend, out_dtype)


def gmm(x_MxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array,
        tuning: GmmTuning = DEFAULT_TUNING) -> jax.Array:
  """[M, N] in x's dtype (float32 accumulation)."""
  _check(x_MxK, w_GxKxN, group_sizes_G, tuning)
  args = backend_lib.match_varying(x_MxK, w_GxKxN, group_sizes_G.astype(jnp.int32))
  return _gmm_vjp(*args, tuning)


def tgmm(x_MxK: jax.Array, dy_MxN: jax.Array, group_sizes_G: jax.Array,
         tuning: GmmTuning = DEFAULT_TUNING, out_dtype=None) -> jax.Array:
  """[G, K, N]: sum over the rows r of group g of outer(x[r], dy[r]). Not differentiable."""
  if x_MxK.ndim != 2 or dy_MxN.ndim != 2 or x_MxK.shape[0] != dy_MxN.shape[0]:
    raise ValueError(f"tgmm: x {x_MxK.shape} and dy {dy_MxN.shape} must be [M, K] and [M, N].")
  if group_sizes_G.ndim != 1 or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise ValueError(f"tgmm: group_sizes is {group_sizes_G.dtype}{list(group_sizes_G.shape)}; "
                     "it must be integer [G].")
  backend_lib.check_pow2("GmmTuning.block_m", tuning.block_m)
  return _tgmm(x_MxK, dy_MxN, group_sizes_G.astype(jnp.int32), tuning,
               jnp.dtype(out_dtype or x_MxK.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_vjp(x_MxK, w_GxKxN, group_sizes_G, tuning):
  return _gmm(x_MxK, w_GxKxN, group_sizes_G, tuning, False)


def _gmm_fwd(x_MxK, w_GxKxN, group_sizes_G, tuning):
  return _gmm_vjp(x_MxK, w_GxKxN, group_sizes_G, tuning), (x_MxK, w_GxKxN, group_sizes_G)


def _gmm_bwd(tuning, res, dy_MxN):
  x_MxK, w_GxKxN, group_sizes_G = res
  dx = _gmm(dy_MxN.astype(w_GxKxN.dtype), w_GxKxN, group_sizes_G, tuning, True)
  dw = _tgmm(x_MxK, dy_MxN.astype(x_MxK.dtype), group_sizes_G, tuning, w_GxKxN.dtype)
  return dx.astype(x_MxK.dtype), dw, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)
