"""The ragged path's bounded receive buffer (moe.ragged_buffer_factor): what overflows it is
dropped by its documented rule and counted, and the layer equals the reference without those
choices, values and gradients (CPU, with the collective emulated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import MoEConfig
from moejax.layout import capacity
from moejax.layout.tables import static_layout
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.harness import layer_step, reference_loss, value_and_grad
from moejax.model.moe.route import route
from tests.moe_helpers import GRAD_LEN, LOSS_LEN, Y_LEN, D, E, F, make_params, ragged_keep, row
from tests.numerics import assert_close, assert_trees_close


def test_buffer_rows():
  assert capacity.ragged_rows(16, 2, 4, 0.0) == 4 * 32           # worst case: never drops
  assert capacity.ragged_rows(16, 2, 4, 1.5) == 48
  assert capacity.ragged_rows(16, 2, 4, 9.0) == 4 * 32           # never above the worst case


@pytest.mark.slow   # over the 8-minute budget of the README test command: .ci/run's slow pass
def test_overflow_is_dropped_by_its_rule_and_matches_the_reference(emulated_collective):
  """(2, 2, 2) mesh, expert 0 favoured, buffer = 1x the balanced share: device 0 overflows.
  Drops per source equal the numpy rule; the layer equals the reference with exactly those
  choices removed."""
  del emulated_collective
  shape, factor = (2, 2, 2), 1.0
  n, slots = shape[1], E // shape[1]
  params = make_params(7)
  params["router"] = params["router"].at[:, 0].add(1.5)
  x = jax.random.normal(jax.random.key(8), (8, 8, D))
  cfg = MoEConfig(num_experts=E, top_k=2, d_ff=F, dispatch="ragged",
                  ragged_buffer_factor=factor)
  (loss, (y, st)), grads = layer_step(cfg, mesh_of_shape(shape))(
      params, x, row(static_layout(1, E, n)))

  expert_TxK = np.asarray(route(x.reshape(-1, D), params["router"], 2,
                                normalize_top_k=True).expert_TxK)
  sources = shape[0] * n
  slot_WxTK = expert_TxK.reshape(sources, -1)            # static layout: slot = expert
  rows = capacity.ragged_rows(slot_WxTK.shape[1] // 2, 2, n, factor)
  keep_WxTK = np.concatenate([ragged_keep(slot_WxTK[r:r + n], slots, rows)
                             for r in range(0, sources, n)])
  dropped_W = (~keep_WxTK).sum(1)
  assert dropped_W.sum() > 0, "the test should overflow a buffer"
  np.testing.assert_array_equal(np.asarray(st.dropped_W), dropped_W)
  np.testing.assert_array_equal(np.asarray(st.received_WxN).sum(), keep_WxTK.sum())

  keep_TxK = jnp.asarray(keep_WxTK.reshape(expert_TxK.shape))
  (ref_loss, (ref_y, _)), ref_grads = value_and_grad(reference_loss(cfg, keep_TxK=keep_TxK))(
      params, x)
  assert_close(y, ref_y, Y_LEN, err_msg="y")
  assert_close(loss, ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(grads, ref_grads, GRAD_LEN)
