"""The tiled cross-entropy equals the plain one (value and gradients), alone and as the
train step's loss; the model's dtype policy holds in the compiled program."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ModelConfig
from moejax.train import step as step_lib
from moejax.train.loss import cross_entropy, tiled_cross_entropy
from tests.helpers import TINY_MODEL, TINY_MOE, tiny_setup, tokens


def _plain(h, w, t):
  return cross_entropy(jnp.einsum("bqd,dv->bqv", h, w), t)


@pytest.mark.parametrize("chunk", [1, 5, 13, 40])
def test_tiled_equals_plain(chunk):
  """Tiles that divide the sequence, that do not (padding), and one larger than it."""
  k = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(k[0], (3, 13, 16))
  w = jax.random.normal(k[1], (16, 37)) * 0.5
  t = jax.random.randint(k[2], (3, 13), 0, 37)
  want, want_g = jax.value_and_grad(_plain, (0, 1))(h, w, t)
  got, got_g = jax.jit(jax.value_and_grad(
      lambda h, w: tiled_cross_entropy(h, w, t, chunk), (0, 1)))(h, w)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for g, r in zip(got_g, want_g):
    # fp32 sums over V (dh) and over B*Q (dw): errors of a few ulps of the largest entry
    np.testing.assert_allclose(g, r, atol=1e-6 * float(jnp.max(jnp.abs(r))) * 8, rtol=1e-5)


def test_tiled_bf16_close_to_fp32():
  """bf16 operands, fp32 accumulation: within bf16's rounding of the fp32 loss."""
  k = jax.random.split(jax.random.key(1), 3)
  h = jax.random.normal(k[0], (2, 32, 64))
  w = jax.random.normal(k[1], (64, 300)) * 0.125
  t = jax.random.randint(k[2], (2, 32), 0, 300)
  want, (dh, dw) = jax.value_and_grad(_plain, (0, 1))(h, w, t)
  got, (gh, gw) = jax.value_and_grad(
      lambda h, w: tiled_cross_entropy(h, w, t, 8, jnp.bfloat16), (0, 1))(h, w)
  assert gh.dtype == h.dtype and gw.dtype == w.dtype
  eps = 2.0 ** -8                       # bf16's relative rounding
  np.testing.assert_allclose(got, want, rtol=4 * eps)
  for g, r in ((gh, dh), (gw, dw)):
    assert float(jnp.max(jnp.abs(g - r))) <= 8 * eps * float(jnp.max(jnp.abs(r)))


def test_train_loss_tiled_equals_plain():
  """The train step's loss and gradients with model.loss_chunk set equal those of the plain
  logits: the same head (final hidden states and unembedding), two losses."""
  mesh, model, tx, layout, _, state = tiny_setup((2, 4, 1))
  tiled = type(model)(dataclasses.replace(TINY_MODEL, loss_chunk=6), TINY_MOE, mesh)
  batch = tokens()

  def value_and_grad(m):
    return jax.jit(jax.value_and_grad(
        lambda p: step_lib.loss_fn(p, m, TINY_MOE, batch, layout)[0]))(state.params)

  (want, want_g), (got, got_g) = value_and_grad(model), value_and_grad(tiled)
  # the tiles sum B*Q terms in another order than the plain mean: a few ulps of fp32
  np.testing.assert_allclose(got, want, rtol=4e-6)
  for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, r, atol=1e-6 * (float(jnp.max(jnp.abs(r))) + 1e-6) * 8,
                               rtol=1e-4)


def test_dtype_policy_in_compiled_program():
  """bf16 model: parameters and optimizer state stay fp32 in the compiled step's outputs;
  the loss is fp32; the trunk's matmuls take bf16 operands; the router's dot is fp32."""
  model_cfg = dataclasses.replace(TINY_MODEL, dtype="bfloat16", loss_chunk=8)
  mesh, model, tx, layout, shardings, state = tiny_setup((2, 4, 1), model_cfg=model_cfg)
  step = jax.jit(lambda s, b, lay: step_lib.train_step(
      s, b, lay, model=model, tx=tx, moe_cfg=TINY_MOE, lr_schedule=lambda s: 1e-3))
  new_state, metrics = jax.eval_shape(step, state, tokens(), layout)
  for leaf in jax.tree.leaves((new_state.params, new_state.opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  assert metrics["loss"].dtype == jnp.float32
  text = step.lower(state, tokens(), layout).as_text()
  dots = re.findall(r"stablehlo\.dot_general.*?->\s*tensor<[^>]*x(\w+)>", text)
  operands = re.findall(r"stablehlo\.dot_general[^\n]*:\s*\(tensor<[^>]*x(\w+)>", text)
  assert "bf16" in operands and "f32" in operands, (set(operands), set(dots))


def test_attention_resolved_when_built():
  """'auto' becomes XLA's attention on CPU devices (cuDNN is for GPU)."""
  from moejax.model.mesh import mesh_of_shape
  from moejax.model.transformer import resolve_attention
  mesh = mesh_of_shape((1, 8, 1))
  bf16 = ModelConfig(dtype="bfloat16")
  assert resolve_attention(bf16, mesh).attention == "xla"
  assert resolve_attention(dataclasses.replace(bf16, attention="cudnn"), mesh).attention == "cudnn"


def test_dense_equivalent_sharded_matches_one_device():
  """moe.dense_equivalent on the 2x4x1 mesh: loss and gradients equal the same model on one
  device; its MoE statistics have the shapes the loop reads, all zero."""
  moe_cfg = dataclasses.replace(TINY_MOE, dense_equivalent=True)
  batch = tokens()

  def value_and_grad(shape):
    _, model, _, layout, _, state = tiny_setup(shape, moe_cfg=moe_cfg)
    (loss, aux), grads = jax.jit(jax.value_and_grad(
        lambda p: step_lib.loss_fn(p, model, moe_cfg, batch, layout), has_aux=True))(
            state.params)
    return loss, aux, grads

  want, _, want_g = value_and_grad((1, 1, 1))
  got, aux, got_g = value_and_grad((2, 4, 1))
  np.testing.assert_allclose(got, want, rtol=4e-6)
  for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, r, atol=1e-6 * (float(jnp.max(jnp.abs(r))) + 1e-6) * 8,
                               rtol=1e-4)
  layers = TINY_MODEL.num_layers // TINY_MOE.moe_every
  assert aux["counts_LxWxE"].shape == (layers, 8, TINY_MOE.num_experts)
  assert not np.any(aux["counts_LxWxE"]) and not np.any(aux["dropped_LxW"])


def test_recomputing_loss_the_lever_study_prices_equals_the_fused_one():
  """benchmarks/gpu/before.py's tiled loss (logits recomputed in the backward), which the lever
  study and the loss-parity study put back to price the fused one: the same value and, bf16
  operands and padding included, the same gradients, bit for bit on CPU (each tile runs the
  same operations on the same values)."""
  from benchmarks.gpu import before
  k = jax.random.split(jax.random.key(2), 3)
  h = jax.random.normal(k[0], (2, 30, 32))
  w = jax.random.normal(k[1], (32, 200)) * 0.2
  t = jax.random.randint(k[2], (2, 30), 0, 200)
  got = jax.jit(jax.value_and_grad(
      lambda h, w: tiled_cross_entropy(h, w, t, 8, jnp.bfloat16), (0, 1)))(h, w)
  old = jax.jit(jax.value_and_grad(
      lambda h, w: before.recompute_tiled_cross_entropy(h, w, t, 8, jnp.bfloat16), (0, 1)))(h, w)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(old)):
    np.testing.assert_array_equal(g, r)
