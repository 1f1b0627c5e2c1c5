"""The row-movement and grouped-matmul ops of the MoE layer, chosen when the program is built.

`moe.kernels = "xla"`: XLA gathers and `jax.lax.ragged_dot`; `"pallas"`: the kernels of
`pallas_kernels`, lowered for the mesh's platform by `moe.pallas_backend` ('auto': interpret
mode on CPU; on GPU Triton, except the grouped matmul on a Hopper GPU (compute capability 9.x
read from the mesh's first device) in bf16/f16, which runs JAX's Mosaic GPU ragged dot; see
pallas_kernels.backend). Both sets have the same contracts, so the layer calls `ops.permute`
etc. without branching:

  permute(x_TxD, token_rows, rows_TxK) -> [rows, D]  out[u] = x[token_rows[u]] (0 outside [0, T));
      rows_TxK is the inverse map (rows each token went to, -1 padded), for the backward.
  combine(buf_rowsxD, row_TxK, gate_TxK) -> f32 [T, D]   sum_k gate * rows[row] (row -1: 0).
  gmm(x_rowsxin, w_Cxinxout, sizes_C) -> [rows, out]   row group g times w[g]; rows past them 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from moejax.config import ConfigError
from moejax.model.moe.combine import combine_rows
from moejax.model.moe.dispatch import permute_rows
from pallas_kernels import backend as backend_lib, gmm_mosaic
from pallas_kernels.gmm import GmmTuning
from pallas_kernels.grouped_matmul import gmm as pallas_gmm
from pallas_kernels.permute import PermuteTuning, permute as pallas_permute
from pallas_kernels.unpermute import CombineTuning, unpermute_combine as pallas_combine


class ExpertOps(NamedTuple):
  name: str
  backend: str              # "xla", or the grouped matmul's resolved Pallas backend
                            # ("interpret", "triton", "mosaic_gpu"; the gathers: "triton")
  permute: Callable
  combine: Callable
  gmm: Callable
  platform: str             # the mesh's devices' platform ("cpu", "gpu", "cuda"): the static
                            # tiles' size follows what a tile costs there (moejax.model.moe.tiled)


def ops_for(kernels: str, platform: str, capability: str | None = None, dtype=None,
            pallas_backend: str = "auto") -> ExpertOps:
  """The op set for `moe.kernels` on the mesh's `platform` ("cpu", "gpu", ...), whose devices
  have compute `capability` ("9.0"; None: not a GPU, or unknown) and compute in `dtype`."""
  if kernels == "xla":
    return ExpertOps("xla", "xla", permute_rows, combine_rows,
                     lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes), platform)
  if kernels == "pallas":
    requested = "triton" if pallas_backend == "mosaic_gpu" else pallas_backend
    backend = backend_lib.resolve(requested, platform)
    gmm_backend = backend_lib.resolve_gmm(pallas_backend, platform, capability, dtype)
    gmm_tuning = GmmTuning(backend=gmm_backend)
    if gmm_backend == "mosaic_gpu":
      gmm_tuning = gmm_mosaic.hopper_tuning(gmm_tuning)
    return ExpertOps(
        "pallas", gmm_backend,
        functools.partial(pallas_permute, tuning=PermuteTuning(backend=backend)),
        functools.partial(pallas_combine, tuning=CombineTuning(backend=backend)),
        functools.partial(pallas_gmm, tuning=gmm_tuning), platform)
  raise ConfigError(f"moe.kernels={kernels!r} is not supported; use 'xla' or 'pallas'.")
