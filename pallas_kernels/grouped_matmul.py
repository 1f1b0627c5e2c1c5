"""Public grouped matmul `gmm` (custom_vjp) and `tgmm`; kernels in gmm.py / gmm_mosaic.py.

    gmm(x [M, I], w [G, I, O], group_sizes [G]) -> [M, O]: row block g times w[g]
    tgmm(x [M, I], dy [M, O], group_sizes [G]) -> [G, I, O]: per-group x^T dy

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


def _check(x_MxI, w_GxIxO, group_sizes_G, tuning):
  if x_MxI.ndim != 2 or w_GxIxO.ndim != 3:
    raise ValueError(f"gmm: x {x_MxI.shape} and w {w_GxIxO.shape} must be [M, I] and "
                     "[G, I, O].")
  if w_GxIxO.shape[1] != x_MxI.shape[1]:
    raise ValueError(f"gmm: x has I={x_MxI.shape[1]} columns but w {w_GxIxO.shape} has "
                     f"I={w_GxIxO.shape[1]}; they must match.")
  if group_sizes_G.shape != (w_GxIxO.shape[0],) or not jnp.issubdtype(group_sizes_G.dtype,
                                                                       jnp.integer):
    raise ValueError(f"gmm: group_sizes is {group_sizes_G.dtype}{list(group_sizes_G.shape)}; "
                     f"it must be integer [G={w_GxIxO.shape[0]}].")
  if x_MxI.dtype != w_GxIxO.dtype:
    raise ValueError(f"gmm: x is {x_MxI.dtype} but w is {w_GxIxO.dtype}; cast both to the "
                     "compute dtype.")
  backend_lib.check_row_tile("GmmTuning.block_m", tuning.block_m,
                             backend_lib.resolve_gmm(tuning.backend, dtype=x_MxI.dtype))


def _gmm(x, w, sizes, tuning, transpose_rhs):
  backend = backend_lib.resolve_gmm(tuning.backend, dtype=x.dtype)
  if backend == "mosaic_gpu":
    return gmm_mosaic.ragged_dot(x, w, sizes, tuning, transpose_rhs)
  return gmm_call(x, w, sizes, tuning, backend, transpose_rhs)


def _tgmm(x, dy, sizes, tuning, out_dtype):
  backend = backend_lib.resolve(tuning.backend)
  if backend == "mosaic_gpu":     # dw stays on Triton: see gmm_mosaic's docstring
    backend = "triton"
  return tgmm_call(x, dy, sizes, tuning, backend, out_dtype)


def gmm(x_MxI: jax.Array, w_GxIxO: jax.Array, group_sizes_G: jax.Array,
        tuning: GmmTuning = DEFAULT_TUNING) -> jax.Array:
  """[M, O] in x's dtype (float32 accumulation)."""
  _check(x_MxI, w_GxIxO, group_sizes_G, tuning)
  args = backend_lib.match_varying(x_MxI, w_GxIxO, group_sizes_G.astype(jnp.int32))
  return _gmm_vjp(*args, tuning)


def tgmm(x_MxI: jax.Array, dy_MxO: jax.Array, group_sizes_G: jax.Array,
         tuning: GmmTuning = DEFAULT_TUNING, out_dtype=None) -> jax.Array:
  """[G, I, O]: sum over the rows r of group g of outer(x[r], dy[r]). Not differentiable."""
  if x_MxI.ndim != 2 or dy_MxO.ndim != 2 or x_MxI.shape[0] != dy_MxO.shape[0]:
    raise ValueError(f"tgmm: x {x_MxI.shape} and dy {dy_MxO.shape} must be [M, I] and [M, O].")
  if group_sizes_G.ndim != 1 or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise ValueError(f"tgmm: group_sizes is {group_sizes_G.dtype}{list(group_sizes_G.shape)}; "
                     "it must be integer [G].")
  backend_lib.check_row_tile("GmmTuning.block_m", tuning.block_m,
                             backend_lib.resolve(tuning.backend))
  return _tgmm(x_MxI, dy_MxO, group_sizes_G.astype(jnp.int32), tuning,
               jnp.dtype(out_dtype or x_MxI.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_vjp(x_MxI, w_GxIxO, group_sizes_G, tuning):
  return _gmm(x_MxI, w_GxIxO, group_sizes_G, tuning, False)


def _gmm_fwd(x_MxI, w_GxIxO, group_sizes_G, tuning):
  return _gmm_vjp(x_MxI, w_GxIxO, group_sizes_G, tuning), (x_MxI, w_GxIxO, group_sizes_G)


def _gmm_bwd(tuning, res, dy_MxO):
  x_MxI, w_GxIxO, group_sizes_G = res
  dx = _gmm(dy_MxO.astype(w_GxIxO.dtype), w_GxIxO, group_sizes_G, tuning, True)
  dw = _tgmm(x_MxI, dy_MxO.astype(x_MxI.dtype), group_sizes_G, tuning, w_GxIxO.dtype)
  return dx.astype(x_MxI.dtype), dw, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)
