"""The optimizer: Adam's moments in bfloat16 follow the float32 ones, in optax's state tree;
weight decay spares norm scales and routing biases in both."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moejax.config import ConfigError, OptimConfig
from moejax.train import optim


def _grads(seed, shape=(64, 32)):
  return {"w": jax.random.normal(jax.random.key(seed), shape), "scale": jnp.ones((32,))}


def test_float32_moments_update_as_optax_does():
  """The dtype-generic Adam at float32 is optax.scale_by_adam: the same updates and state."""
  ours, theirs = optim.scale_by_adam(0.9, 0.95, 1e-8, jnp.float32), optax.scale_by_adam(
      0.9, 0.95, 1e-8)
  params = _grads(0)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  for step in range(5):
    g = _grads(step + 1)
    u_ours, s_ours = ours.update(g, s_ours, params)
    u_theirs, s_theirs = theirs.update(g, s_theirs, params)
    for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs)):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)


def test_bfloat16_moments_are_stored_in_bfloat16_and_track_float32():
  """bfloat16 moments: the state is bfloat16, the tree is the float32 optimizer's (so a
  checkpoint loads either way), and after 50 steps the updates are the float32 ones to
  bfloat16's precision (each moment rounds to 8 bits once a step; 2e-2 of an update of
  magnitude ~1 is a few such roundings)."""
  cfg32, cfg16 = OptimConfig(), OptimConfig(moments_dtype="bfloat16")
  tx32, tx16 = optim.optimizer(cfg32, 100), optim.optimizer(cfg16, 100)
  params = _grads(0)
  s32, s16 = tx32.init(params), tx16.init(params)
  assert jax.tree.structure(s32) == jax.tree.structure(s16)
  adam16 = s16[1][0]
  assert {x.dtype for x in jax.tree.leaves((adam16.mu, adam16.nu))} == {jnp.dtype("bfloat16")}
  for step in range(50):
    g = _grads(step + 1)
    u32, s32 = tx32.update(g, s32, params)
    u16, s16 = tx16.update(g, s16, params)
  lr = optim.schedule(cfg32, 100)(49)
  for a, b in zip(jax.tree.leaves(u32), jax.tree.leaves(u16)):
    np.testing.assert_allclose(np.asarray(b) / lr, np.asarray(a) / lr, atol=2e-2)


def test_bfloat16_moments_refuse_a_beta_they_cannot_follow():
  with pytest.raises(ConfigError, match=r"optim.moments_dtype='bfloat16'.*b2=0.999.*betas <="):
    OptimConfig(moments_dtype="bfloat16", b2=0.999).validate()
  with pytest.raises(ConfigError, match="optim.moments_dtype='float16' is not supported"):
    OptimConfig(moments_dtype="float16").validate()


@pytest.mark.parametrize("moments_dtype", ["float32", "bfloat16"])
def test_weight_decay_spares_norm_scales_and_routing_biases(moments_dtype):
  """With zero gradients only weight decay moves a parameter: a matrix shrinks, an RMSNorm
  scale and a routing bias held as a parameter (the multi-token module's) stay as they are."""
  cfg = OptimConfig(weight_decay=0.1, warmup_steps=1, moments_dtype=moments_dtype)
  tx = optim.optimizer(cfg, 10)
  params = {"w": jnp.ones((4, 4)), "scale": jnp.ones((4,)), "router_bias": jnp.full((8,), 0.5)}
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  new = optax.apply_updates(params, updates)
  assert float(jnp.max(new["w"])) < 1.0
  np.testing.assert_array_equal(new["scale"], params["scale"])
  np.testing.assert_array_equal(new["router_bias"], params["router_bias"])
