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


def _plain_pack_and_combine(index, top_k):
  """The forward gathers with autodiff's backward (scatter-adds): the rule the gather-based
  backward of pack and combine must equal."""
  import jax

  def pack(x):
    return dispatch.gather_rows(x, index.buf_token_rows)

  def combine_plain(out, gate):
    out_ext = jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])
    rows = index.buf_index_TK.reshape(-1, top_k)
    return jnp.einsum("tkd,tk->td", out_ext[jnp.where(rows >= 0, rows, out.shape[0])], gate)
  return jax, pack, combine_plain


def test_pack_and_combine_backward_gather_and_equal_autodiff_of_the_gathers():
  """pack's and combine's backward (gathers by the rows' inverse map) equal autodiff of the
  forward gathers (scatter-adds), dropped choices and empty rows included, and the backward
  program has no scatter of the [rows, D] activations: only the int32 inverse map is one.
  Tolerance: float32, sums of at most K = 3 terms reordered (a few ulps of |x| ~ 3)."""
  rng = np.random.default_rng(0)
  tokens, top_k, slots, cap, d = 37, 3, 5, 16, 16
  # skewed: the hot slots overflow (drops), the cold ones leave rows empty
  slot_TK = jnp.asarray(rng.choice(slots, tokens * top_k, p=[0.5, 0.3, 0.1, 0.05, 0.05]),
                        jnp.int32)
  index = dispatch.buffer_index(slot_TK, top_k, slots, cap)
  assert int(index.dropped) > 0 and int(jnp.sum(index.buf_token_rows == tokens)) > 0
  jax, pack_plain, combine_plain = _plain_pack_and_combine(index, top_k)
  x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((slots * cap, d)), jnp.float32)
  got = jax.vjp(lambda x: dispatch.pack(x, index), x)[1](ct)[0]
  want = jax.vjp(pack_plain, x)[1](ct)[0]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  out = jnp.asarray(rng.standard_normal((slots * cap, d)), jnp.float32)
  gate = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
  got_out, got_gate = jax.vjp(lambda o, g: combine(o, index, g), out, gate)[1](dy)
  want_out, want_gate = jax.vjp(combine_plain, out, gate)[1](dy)
  np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-6)
  np.testing.assert_allclose(got_gate, want_gate, rtol=1e-6, atol=1e-6)
  grads = jax.jit(jax.grad(lambda x, o, g: jnp.sum(dispatch.pack(x, index) * o) +
                           jnp.sum(combine(o, index, g) * dy), argnums=(0, 1, 2)))
  hlo = grads.lower(x, out, gate).as_text()
  scatters = [line for line in hlo.splitlines() if "scatter" in line and "f32[" in
              line.split("=")[0]]
  assert not scatters, scatters
