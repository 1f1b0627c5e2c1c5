"""Tolerances for comparing a float32 computation with its reference, scaled to what is compared.

A fixed atol/rtol holds only on the machine a test was written on: another CPU (or another
XLA version) sums in another order. These helpers derive the tolerance from the compared
values' magnitude and the float32 reductions that produced them.
"""

from __future__ import annotations

import math

import jax
import numpy as np

EPS_F32 = float(np.finfo(np.float32).eps)   # 2^-23
EPS_TF32 = 2.0 ** -10                       # f32 dots on GPU (Triton, XLA) round inputs to TF32
EPS_BF16 = 2.0 ** -7                        # bf16 values (f32 accumulation, rounded on output)
SLACK = 4                                   # margin over the estimate: other CPUs, other orders


def tolerance(want, n: int = 1, eps: float = EPS_F32) -> float:
  """SLACK * eps * sqrt(n) * max|want|; n: the float32 reduction lengths along the path from
  the inputs to `want`, summed (a forward dot over K, then a backward dot over N: K + N)."""
  # n roundings in another order drift like a random walk, ~eps * sqrt(n) * size (max|want|).
  return SLACK * eps * math.sqrt(max(n, 1)) * float(np.max(np.abs(want), initial=0.0))


def assert_close(got, want, n: int = 1, eps: float = EPS_F32, err_msg: str = "") -> None:
  """|got - want| <= tolerance(want, n, eps) elementwise (rtol 0: the scale is max|want|)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  atol = tolerance(want, n, eps)
  np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=(
      f"{err_msg} (atol {atol:.3g} = {SLACK} * eps {eps:.3g} * sqrt(n={n}) * max|want| "
      f"{np.max(np.abs(want), initial=0.0):.4g})"))


def assert_trees_close(got, want, n: int = 1, eps: float = EPS_F32) -> None:
  """`assert_close` leaf by leaf, each leaf scaled by its own max|want|."""
  want_leaves = jax.tree.leaves(want)
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
  for (path, g), w in zip(got_leaves, want_leaves):
    assert_close(g, w, n, eps, jax.tree_util.keystr(path))
