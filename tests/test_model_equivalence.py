"""The whole model on a mesh equals the same model on one device: loss and grads."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from moejax.train import step as step_lib
from tests.helpers import TINY_MODEL, TINY_MOE, tokens
from tests.moe_helpers import cached_setup, model_lengths, model_loss_and_grads
from tests.numerics import assert_close, assert_trees_close

LOSS_LEN, GRAD_LEN = model_lengths()


def _loss_and_grads(shape):
  """(loss, grads, aux) of the tiny model on `shape`, computed once per process."""
  return model_loss_and_grads(shape)[:3]


@pytest.fixture(scope="module")
def single_device():
  return _loss_and_grads((1, 1, 1))


@pytest.mark.parametrize("shape", [(2, 4, 1), (2, 2, 2)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_model_on_mesh_matches_one_device(single_device, shape):
  ref_loss, ref_grads, ref_aux = single_device
  loss, grads, aux = _loss_and_grads(shape)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  assert_close(loss, ref_loss, LOSS_LEN, err_msg="loss")
  np.testing.assert_array_equal(aux["counts_LxWxE"].sum(1), ref_aux["counts_LxWxE"].sum(1))
  assert_trees_close(grads, ref_grads, GRAD_LEN)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_train_step_matches_one_device():
  """One optimizer step on the mesh gives the same moments and parameters as on one device.

  Adam's first update is lr * g / (|g| + eps): its sign flips with rounding where the
  gradient is ~0, so parameters are compared where the gradient is clearly non-zero."""
  out = {}
  for shape in [(1, 1, 1), (2, 4, 1)]:
    _, model, tx, layout, shardings, state = cached_setup(shape, TINY_MODEL, TINY_MOE)
    step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, moe_cfg=TINY_MOE,
                                     lr_schedule=lambda s: 0.0),
                   in_shardings=(shardings, None, None), out_shardings=(shardings, None),
                   donate_argnums=0)
    if shape == (1, 1, 1):
      p0 = jax.device_get(state.params)      # before the step donates them
    state, metrics = step(state, tokens(), layout)
    out[shape] = (jax.device_get(state), float(metrics["loss"]))
  (s1, l1), (s8, l8) = out[(1, 1, 1)], out[(2, 4, 1)]
  assert_close(l8, l1, LOSS_LEN, err_msg="loss")
  adam1, adam8 = s1.opt_state[1][0], s8.opt_state[1][0]
  assert_trees_close(adam8.mu, adam1.mu, GRAD_LEN)       # (1 - b1) g
  assert_trees_close(adam8.nu, adam1.nu, 4 * GRAD_LEN)   # (1 - b2) g^2: twice g's relative error
  for a, b, init, mu in zip(jax.tree.leaves(s8.params), jax.tree.leaves(s1.params),
                            jax.tree.leaves(p0), jax.tree.leaves(adam1.mu)):
    clear = np.abs(mu) > 1e-6
    # The update is about lr * sign(g) where g is clear of 0: compare it to its own size.
    np.testing.assert_allclose(a[clear], b[clear], atol=1e-3 * np.abs(b - init).max())
    assert np.abs(b - init).max() > 0, "the first optimizer step must update every parameter"


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_model_is_causal():
  """Changing token j leaves the logits of every position before j unchanged."""
  _, model, _, layout, _, state = cached_setup((2, 4, 1), TINY_MODEL, TINY_MOE)
  apply = jax.jit(lambda p, t: model.apply({"params": p}, t, layout)[0].logits())
  toks = tokens()[:, :-1]
  j = 9
  other = toks.at[:, j].set((toks[:, j] + 7) % 256)
  a, b = np.asarray(apply(state.params, toks)), np.asarray(apply(state.params, other))
  np.testing.assert_array_equal(a[:, :j], b[:, :j])
  assert np.abs(a[:, j:] - b[:, j:]).max() > 0


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_remat_equals_no_remat():
  import dataclasses

  base = _loss_and_grads((2, 4, 1))
  loss, grads, _, _ = model_loss_and_grads(
      (2, 4, 1), dataclasses.replace(TINY_MODEL, remat=True), TINY_MOE)
  assert_close(loss, base[0], LOSS_LEN, err_msg="loss")
  assert_trees_close(grads, base[1], GRAD_LEN)
