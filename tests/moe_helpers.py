"""The MoE layer's comparison with the single-device reference, shared by its tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.moe.layer import moe_apply
from moejax.model.moe.reference import moe_reference

E, D, F = 8, 16, 32
MESHES = [(1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]


def row(layout, layer=0):
  """One MoE layer's row of a Layout."""
  return jax.tree.map(lambda a: a[layer], layout)


def make_params(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  return {
      "router": jax.random.normal(k[0], (D, E)),
      "w_gate": jax.random.normal(k[1], (E, D, F)) / np.sqrt(D),
      "w_up": jax.random.normal(k[2], (E, D, F)) / np.sqrt(D),
      "w_down": jax.random.normal(k[3], (E, F, D)) / np.sqrt(F),
  }


def objective(y, bal, z):
  # A non-trivial function of the output so every gradient path is exercised.
  return jnp.sum(jnp.sin(y) * y) + 0.1 * bal + 0.01 * z


def sharded_value_and_grad(params, x, layout_row, cfg, mesh):
  def f(p, x):
    y, st = moe_apply(p, x, layout_row, cfg, mesh)
    return objective(y, st.balance_loss, st.z_loss), (y, st)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)


def reference_value_and_grad(params, x, top_k):
  def f(p, x):
    y, counts, bal, z = moe_reference(p, x, top_k)
    return objective(y, bal, z), (y, counts)
  return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)


def assert_trees_close(a, b, atol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path))
