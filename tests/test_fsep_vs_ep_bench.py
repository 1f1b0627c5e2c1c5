"""The layer as benchmarks.layer.fsep_vs_ep and balance_pays time it (the harness's placement):
under a permuted layout slot s computes with expert slot_expert[s]'s weights, and the check
they run before timing (moejax.model.moe.harness.check_against_reference) holds the layer to
the single-device reference (and fails when the weights are not in slot order)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.layer import balance_setup as setup
from moejax.config import MoEConfig
from moejax.layout import host_layout as placement_lib
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.harness import check_against_reference

N, E, K, D, F = 8, 16, 2, 16, 32


def _params(rng):
  return {"router": rng.standard_normal((D, E)).astype(np.float32),
          "w_gate": rng.standard_normal((E, D, F)).astype(np.float32) / D ** 0.5,
          "w_up": rng.standard_normal((E, D, F)).astype(np.float32) / D ** 0.5,
          "w_down": rng.standard_normal((E, F, D)).astype(np.float32) / F ** 0.5}


@pytest.mark.slow     # two compiles of the layer's fwd + bwd: ~8-18 s on two cores
def test_a_permuted_ep_layout_matches_the_reference_and_a_wrong_order_does_not():
  rng = np.random.default_rng(0)
  params = _params(rng)
  x = rng.standard_normal((N, 8, D)).astype(np.float32)
  perm = placement_lib.one_copy(rng.permutation(E).astype(np.int32), N)
  layout = setup.device_layout("smartmoe", [perm], E)
  cfg = MoEConfig(num_experts=E, top_k=K, d_ff=F, capacity="device")
  mesh = mesh_of_shape((1, N, 1))
  check_against_reference(cfg, mesh, jax.tree.map(lambda a: a[0], layout), params, x)
  # Weights in expert order while the router sends expert e's rows to e's slot in the
  # permutation: each slot computes with another expert's weights.
  wrong = layout.replace(slot_expert_LxS=jnp.arange(E, dtype=jnp.int32)[None])
  with pytest.raises(RuntimeError, match="differs from the single-device reference"):
    check_against_reference(cfg, mesh, jax.tree.map(lambda a: a[0], wrong), params, x)
