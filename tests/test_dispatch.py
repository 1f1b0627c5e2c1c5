"""Unit tests of the dense dispatch: buffer index (slot order, capacity, drops), combine."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moejax.model.moe import dispatch
from moejax.model.moe.combine import combine


def test_capacity_rounds_up_and_is_positive():
  assert dispatch.capacity(10, 2, 8, 1.0) == 3      # ceil(20 / 8)
  assert dispatch.capacity(1, 1, 64, 0.01) == 1
  assert dispatch.capacity(16, 2, 8, 1.25) == 5     # ceil(1.25 * 4)


def test_buffer_index_orders_by_slot_and_drops_late_choices():
  # 4 tokens, top-2 -> 8 choices, 3 slots, capacity 2.
  slot_TK = jnp.array([0, 1, 0, 2, 0, 1, 2, 2], jnp.int32)
  index = dispatch.buffer_index(slot_TK, top_k=2, num_slots=3, cap=2)
  # slot 0 gets choices 0, 2 (choice 4 dropped); slot 1 gets 1, 5; slot 2 gets 3, 6 (7 dropped).
  np.testing.assert_array_equal(np.asarray(index.buf_index_TK), [0, 2, 1, 4, -1, 3, 5, -1])
  # buffer rows hold tokens (choice // top_k), empty rows hold the sentinel T=4.
  np.testing.assert_array_equal(np.asarray(index.buf_token_rows), [0, 1, 0, 2, 1, 3])
  assert int(index.dropped) == 2


def test_pack_and_combine_roundtrip():
  x_TxD = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) + 1
  slot_TK = jnp.array([1, 0, 0, 1, 1, 0, 0, 1], jnp.int32)
  index = dispatch.buffer_index(slot_TK, top_k=2, num_slots=2, cap=4)
  buf = dispatch.pack(x_TxD, index)
  assert buf.shape == (8, 3)
  gate = jnp.full((4, 2), 0.5)
  # An identity "expert" returns each row: combine must give back the tokens.
  np.testing.assert_allclose(np.asarray(combine(buf, index, gate)), np.asarray(x_TxD))


def test_slot_major_reshapes_are_inverse():
  x = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2 * 3 * 4, 5)
  y = dispatch.to_slot_major(x, num_devices=2, slots=3)
  assert y.shape == (3, 8, 5)
  np.testing.assert_array_equal(np.asarray(dispatch.from_slot_major(y, 2)), np.asarray(x))
