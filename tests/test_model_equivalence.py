"""The whole model on a mesh equals the same model on one device: loss and grads."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from moejax.train import step as step_lib
from tests.helpers import TINY_MOE, tiny_setup, tokens


def _loss_and_grads(shape):
  _, model, _, layout, _, state = tiny_setup(shape)
  f = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=TINY_MOE), has_aux=True))
  (loss, aux), grads = f(state.params, batch_BxL1=tokens(), layout=layout)
  return float(loss), jax.device_get(grads), jax.device_get(aux)


@pytest.fixture(scope="module")
def single_device():
  return _loss_and_grads((1, 1, 1))


@pytest.mark.parametrize("shape", [(2, 4, 1), (2, 2, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_model_on_mesh_matches_one_device(single_device, shape):
  ref_loss, ref_grads, ref_aux = single_device
  loss, grads, aux = _loss_and_grads(shape)
  assert int(np.sum(aux["dropped_LxS"])) == 0
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_array_equal(aux["counts_LxSxE"].sum(1), ref_aux["counts_LxSxE"].sum(1))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_train_step_matches_one_device():
  """One optimizer step on the mesh gives the same moments and parameters as on one device.

  Adam's first update is lr * g / (|g| + eps): its sign flips with rounding where the
  gradient is ~0, so parameters are compared where the gradient is clearly non-zero."""
  out = {}
  for shape in [(1, 1, 1), (2, 4, 1)]:
    _, model, tx, layout, shardings, state = tiny_setup(shape)
    step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, moe_cfg=TINY_MOE,
                                     lr_schedule=lambda s: 0.0),
                   in_shardings=(shardings, None, None), out_shardings=(shardings, None),
                   donate_argnums=0)
    state, metrics = step(state, tokens(), layout)
    out[shape] = (jax.device_get(state), float(metrics["loss"]))
  (s1, l1), (s8, l8) = out[(1, 1, 1)], out[(2, 4, 1)]
  np.testing.assert_allclose(l8, l1, rtol=1e-5)
  adam1, adam8 = s1.opt_state[1][0], s8.opt_state[1][0]
  for a, b in zip(jax.tree.leaves((adam8.mu, adam8.nu)), jax.tree.leaves((adam1.mu, adam1.nu))):
    np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-3)
  p0 = jax.device_get(tiny_setup((1, 1, 1))[-1].params)
  for a, b, init, mu in zip(jax.tree.leaves(s8.params), jax.tree.leaves(s1.params),
                            jax.tree.leaves(p0), jax.tree.leaves(adam1.mu)):
    clear = np.abs(mu) > 1e-6
    np.testing.assert_allclose(a[clear], b[clear], atol=1e-5)
    assert np.abs(b - init).max() > 0, "the first optimizer step must update every parameter"


def test_model_is_causal():
  """Changing token j leaves the logits of every position before j unchanged."""
  _, model, _, layout, _, state = tiny_setup((2, 4, 1))
  apply = jax.jit(lambda p, t: model.apply({"params": p}, t, layout)[0])
  toks = tokens()[:, :-1]
  j = 9
  other = toks.at[:, j].set((toks[:, j] + 7) % 256)
  a, b = np.asarray(apply(state.params, toks)), np.asarray(apply(state.params, other))
  np.testing.assert_array_equal(a[:, :j], b[:, :j])
  assert np.abs(a[:, j:] - b[:, j:]).max() > 0


def test_remat_equals_no_remat():
  import dataclasses

  from tests.helpers import TINY_MODEL
  base = _loss_and_grads((2, 4, 1))
  _, model, _, layout, _, state = tiny_setup((2, 4, 1),
                                             dataclasses.replace(TINY_MODEL, remat=True))
  f = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=TINY_MOE), has_aux=True))
  (loss, _), grads = f(state.params, batch_BxL1=tokens(), layout=layout)
  np.testing.assert_allclose(float(loss), base[0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(base[1])):
    np.testing.assert_allclose(a, b, atol=1e-6)
