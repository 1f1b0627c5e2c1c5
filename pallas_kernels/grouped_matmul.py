"""Public grouped matmul `gmm` (custom_vjp) and `tgmm`; kernels in gmm.py / gmm_mosaic.py.

    gmm(x [rows, in], w [C, in, out], group_sizes [C]) -> [rows, out]: row block g times w[g]
    tgmm(x [rows, in], dy [rows, out], group_sizes [C]) -> [C, in, out]: per-group x^T dy

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


def _check(x_rowsxin, w_Cxinxout, group_sizes_C, tuning):
  if x_rowsxin.ndim != 2 or w_Cxinxout.ndim != 3:
    raise ValueError(f"gmm: x {x_rowsxin.shape} and w {w_Cxinxout.shape} must be [rows, in] and "
                     "[C, in, out].")
  if w_Cxinxout.shape[1] != x_rowsxin.shape[1]:
    raise ValueError(f"gmm: x has I={x_rowsxin.shape[1]} columns but w {w_Cxinxout.shape} has "
                     f"I={w_Cxinxout.shape[1]}; they must match.")
  if group_sizes_C.shape != (w_Cxinxout.shape[0],) or not jnp.issubdtype(group_sizes_C.dtype,
                                                                       jnp.integer):
    raise ValueError(f"gmm: group_sizes is {group_sizes_C.dtype}{list(group_sizes_C.shape)}; "
                     f"it must be integer [G={w_Cxinxout.shape[0]}].")
  if x_rowsxin.dtype != w_Cxinxout.dtype:
    raise ValueError(f"gmm: x is {x_rowsxin.dtype} but w is {w_Cxinxout.dtype}; cast both to the "
                     "compute dtype.")
  backend_lib.check_row_tile("GmmTuning.block_m", tuning.block_m,
                             backend_lib.resolve_gmm(tuning.backend, dtype=x_rowsxin.dtype))


def _gmm(x, w, sizes, tuning, transpose_rhs):
  backend = backend_lib.resolve_gmm(tuning.backend, dtype=x.dtype)
  if backend == "mosaic_gpu":
    return gmm_mosaic.ragged_dot(x, w, sizes, tuning, transpose_rhs)
  return gmm_call(x, w, sizes, tuning, backend, transpose_rhs)


def _tgmm(x, dy, sizes, tuning, out_dtype):
  backend = backend_lib.resolve(tuning.backend)
  if backend == "mosaic_gpu" and tuning.mosaic_dw:
    return gmm_mosaic.tgmm(x, dy, sizes, tuning, out_dtype)
  if backend == "mosaic_gpu":     # dw on Triton unless mosaic_dw: see gmm_mosaic's docstring
    backend = "triton"
  return tgmm_call(x, dy, sizes, tuning, backend, out_dtype)


def gmm(x_rowsxin: jax.Array, w_Cxinxout: jax.Array, group_sizes_C: jax.Array,
        tuning: GmmTuning = DEFAULT_TUNING) -> jax.Array:
  """[rows, out] in x's dtype (float32 accumulation)."""
  _check(x_rowsxin, w_Cxinxout, group_sizes_C, tuning)
  args = backend_lib.match_varying(x_rowsxin, w_Cxinxout, group_sizes_C.astype(jnp.int32))
  return _gmm_vjp(*args, tuning)


def tgmm(x_rowsxin: jax.Array, dy_rowsxout: jax.Array, group_sizes_C: jax.Array,
         tuning: GmmTuning = DEFAULT_TUNING, out_dtype=None) -> jax.Array:
  """[C, in, out]: sum over the rows r of group g of outer(x[r], dy[r]). Not differentiable."""
  if x_rowsxin.ndim != 2 or dy_rowsxout.ndim != 2 or x_rowsxin.shape[0] != dy_rowsxout.shape[0]:
    raise ValueError(f"tgmm: x {x_rowsxin.shape} and dy {dy_rowsxout.shape} must be [rows, in] "
                     "and [rows, out].")
  if group_sizes_C.ndim != 1 or not jnp.issubdtype(group_sizes_C.dtype, jnp.integer):
    raise ValueError(f"tgmm: group_sizes is {group_sizes_C.dtype}{list(group_sizes_C.shape)}; "
                     "it must be integer [C].")
  backend_lib.check_row_tile("GmmTuning.block_m", tuning.block_m,
                             backend_lib.resolve(tuning.backend))
  return _tgmm(x_rowsxin, dy_rowsxout, group_sizes_C.astype(jnp.int32), tuning,
               jnp.dtype(out_dtype or x_rowsxin.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_vjp(x_rowsxin, w_Cxinxout, group_sizes_C, tuning):
  return _gmm(x_rowsxin, w_Cxinxout, group_sizes_C, tuning, False)


def _gmm_fwd(x_rowsxin, w_Cxinxout, group_sizes_C, tuning):
  return (_gmm_vjp(x_rowsxin, w_Cxinxout, group_sizes_C, tuning),
          (x_rowsxin, w_Cxinxout, group_sizes_C))


def _gmm_bwd(tuning, res, dy_rowsxout):
  x_rowsxin, w_Cxinxout, group_sizes_C = res
  dx = _gmm(dy_rowsxout.astype(w_Cxinxout.dtype), w_Cxinxout, group_sizes_C, tuning, True)
  dw = _tgmm(x_rowsxin, dy_rowsxout.astype(x_rowsxin.dtype), group_sizes_C, tuning,
             w_Cxinxout.dtype)
  return dx.astype(x_rowsxin.dtype), dw, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)
