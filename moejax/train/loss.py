"""The language-model loss: mean next-token cross-entropy, plain or tiled.

The loss takes the model's head whole (moejax.model.transformer.Head: the final-normed hidden
states and the unembedding), never a parameter by name; `head_loss` picks the variant from the
config when the step is built. `cross_entropy` takes the [B, Q, vocab] logits.
`tiled_cross_entropy` takes the final hidden states and the unembedding and never holds more
than one tile of logits: it scans the sequence in tiles of `chunk` positions, and when it is
differentiated its forward pass also takes each tile's gradient (softmax minus the one-hot,
then the two matmuls of the backward) while the tile's logits are at hand, so the backward
pass only scales the stored gradients by the loss's cotangent (a scalar) instead of
recomputing every tile's logits: one [tokens, D] x [D, vocab] matmul and the elementwise
passes over the fp32 tile fewer (a fused linear cross-entropy). The [B, Q, vocab] fp32 logits
and their gradient are most of a large-vocabulary step's temporary memory (GPT-2's 50,304
classes: 13 GB per 65,536 tokens, twice); the stored gradients are the size of h and w.

Dtype policy: the tile's matmuls take `compute_dtype` operands (the model's dtype) with fp32
accumulation; log-sum-exp, the loss and the unembedding's gradient are fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model.transformer import Head


def head_loss(cfg: ModelConfig) -> Callable[[Head, jax.Array], jax.Array]:
  """ce(head, targets_BxQ): `tiled_cross_entropy` when `model.loss_chunk` > 0 (the logits one
  tile of positions at a time, matmuls in the model's dtype), else `cross_entropy` of the
  head's logits."""
  if cfg.loss_chunk:
    return lambda head, targets_BxQ: tiled_cross_entropy(
        head.h_BxQxD, head.w_Dxvocab, targets_BxQ, cfg.loss_chunk, jnp.dtype(cfg.dtype))
  return lambda head, targets_BxQ: cross_entropy(head.logits(), targets_BxQ)


def cross_entropy(logits_BxQxvocab: jax.Array, targets_BxQ: jax.Array) -> jax.Array:
  logp = jax.nn.log_softmax(logits_BxQxvocab.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets_BxQ[..., None], axis=-1))


def _tiles(h_BxQxD, targets_BxQ, chunk):
  """[n, B, chunk, D] hidden tiles and [n, B, chunk] targets, the sequence padded to a
  multiple of `chunk` with target -1 (no loss)."""
  batch, length, d_model = h_BxQxD.shape
  pad = -length % chunk
  h = jnp.pad(h_BxQxD, ((0, 0), (0, pad), (0, 0)))
  t = jnp.pad(targets_BxQ, ((0, 0), (0, pad)), constant_values=-1)
  n = (length + pad) // chunk
  return (h.reshape(batch, n, chunk, d_model).swapaxes(0, 1),
          t.reshape(batch, n, chunk).swapaxes(0, 1))


def _tile_logits(h_BxtilexD, w_Dxvocab, compute_dtype):
  return jnp.einsum("bcd,dv->bcv", h_BxtilexD.astype(compute_dtype),
                    w_Dxvocab.astype(compute_dtype), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def tiled_cross_entropy(h_BxQxD: jax.Array, w_Dxvocab: jax.Array, targets_BxQ: jax.Array,
                        chunk: int, compute_dtype=jnp.float32) -> jax.Array:
  """mean over B x Q of -log softmax(h @ w)[target], `chunk` positions of logits at a time."""
  h_n, t_n = _tiles(h_BxQxD, targets_BxQ, chunk)

  def tile(total, xs):
    h, t = xs
    logits = _tile_logits(h, w_Dxvocab, compute_dtype)
    return total + _tile_loss(logits, t)[0], None

  total, _ = jax.lax.scan(tile, jnp.zeros((), jnp.float32), (h_n, t_n))
  return total / targets_BxQ.size


def _tile_loss(logits_Bxtilexvocab, t_Bxtile):
  """(the tile's summed loss, its log-sum-exp per token); target -1 adds nothing."""
  lse_Bxtile = jax.nn.logsumexp(logits_Bxtilexvocab, axis=-1)
  picked = jnp.take_along_axis(logits_Bxtilexvocab, jnp.maximum(t_Bxtile, 0)[..., None],
                               axis=-1)[..., 0]
  return jnp.sum(jnp.where(t_Bxtile >= 0, lse_Bxtile - picked, 0.0)), lse_Bxtile


def _tile_grads(h_BxtilexD, t_Bxtile, logits, lse_Bxtile, w_Dxvocab, scale, compute_dtype):
  """One tile's (dh, dw) for a loss scaled by `scale`: softmax - one_hot(target), zero on
  padding, through the tile's two matmuls (fp32 accumulation)."""
  vocab = w_Dxvocab.shape[1]
  d_Bxtilexvocab = (jnp.exp(logits - lse_Bxtile[..., None]) -
                    jax.nn.one_hot(t_Bxtile, vocab, dtype=jnp.float32))
  d_Bxtilexvocab = jnp.where((t_Bxtile >= 0)[..., None], d_Bxtilexvocab * scale,
                             0.0).astype(compute_dtype)
  dh = jnp.einsum("bcv,dv->bcd", d_Bxtilexvocab, w_Dxvocab.astype(compute_dtype),
                  preferred_element_type=jnp.float32)
  dw = jnp.einsum("bcd,bcv->dv", h_BxtilexD.astype(compute_dtype), d_Bxtilexvocab,
                  preferred_element_type=jnp.float32)
  return dh, dw


def _forward(h_BxQxD, w_Dxvocab, targets_BxQ, chunk, compute_dtype):
  """The loss and, tile by tile, its gradient for a cotangent of 1 (the residuals)."""
  h_n, t_n = _tiles(h_BxQxD, targets_BxQ, chunk)
  scale = 1.0 / targets_BxQ.size

  def tile(carry, xs):
    total, dw_Dxvocab = carry
    h, t = xs
    logits = _tile_logits(h, w_Dxvocab, compute_dtype)
    loss, lse_Bxtile = _tile_loss(logits, t)
    dh, dw_tile = _tile_grads(h, t, logits, lse_Bxtile, w_Dxvocab, scale, compute_dtype)
    return (total + loss, dw_Dxvocab + dw_tile), dh

  (total, dw), dh_n = jax.lax.scan(
      tile, (jnp.zeros((), jnp.float32), jnp.zeros(w_Dxvocab.shape, jnp.float32)), (h_n, t_n))
  batch, length, d_model = h_BxQxD.shape
  dh = dh_n.swapaxes(0, 1).reshape(batch, -1, d_model)[:, :length]
  return total * scale, (dh.astype(h_BxQxD.dtype), dw.astype(w_Dxvocab.dtype))


def _bwd(chunk, compute_dtype, res, g):
  dh, dw = res
  return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None


tiled_cross_entropy.defvjp(_forward, _bwd)
