"""Three of the library's paths as they were before their one-GPU levers, for the studies that
price each lever alone (`gpu_levers`) and check its loss against the old path's
(`loss_parity`); the library keeps only the new ones.

  - `scatter_backward()`: the MoE layer's row gathers (pack, and combine under XLA kernels)
    differentiated by autodiff, whose transpose of a gather is a scatter-add; the library's
    `dispatch.permute_rows` and `combine.combine_rows` gather through the rows' inverse map.
  - `recompute_loss()`: the tiled loss keeps one log-sum-exp per token and recomputes each
    tile's logits in its backward pass; the library's takes each tile's gradient in the
    forward pass (a fused linear cross-entropy).
  - `pipelined_microbatches()`: microbatches on one stage run as a pipeline of one stage
    (moejax.model.pipeline), differentiated: its backward fills a stack of every layer's
    gradients with zeros per microbatch and adds it to a carried sum; the library's train step
    loops over the microbatches and adds each layer's gradient in place
    (`step.accumulated_loss_and_grads`).

Each is a context manager that swaps the module attributes the step reads when it is traced,
so a program built inside it has the old path and one built after it the library's.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp


@contextlib.contextmanager
def _swapped(swaps):
  """Set each (module, name, value) of `swaps`; restore them on exit."""
  saved = [(mod, name, getattr(mod, name)) for mod, name, _ in swaps]
  try:
    for mod, name, value in swaps:
      setattr(mod, name, value)
    yield
  finally:
    for mod, name, value in saved:
      setattr(mod, name, value)


def scatter_backward():
  """The MoE row gathers without their gather backward: autodiff's scatter-adds."""
  from moejax.model.moe import combine, dispatch, ops

  def gather(x_TxD, token_rows, rows_TxK):
    return dispatch.gather_rows(x_TxD, token_rows)

  plain_combine = combine.combine_rows.fun      # the custom_vjp's primal: the same forward
  return _swapped([(dispatch, "permute_rows", gather), (ops, "permute_rows", gather),
                   (combine, "combine_rows", plain_combine), (ops, "combine_rows", plain_combine)])


def recompute_loss():
  """The tiled loss whose backward pass recomputes each tile's logits."""
  from moejax.train import loss
  return _swapped([(loss, "tiled_cross_entropy", recompute_tiled_cross_entropy)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def recompute_tiled_cross_entropy(h_BxQxD, w_Dxvocab, targets_BxQ, chunk: int,
                                  compute_dtype=jnp.float32):
  """`moejax.train.loss.tiled_cross_entropy`'s value; its backward recomputes the logits."""
  return _forward(h_BxQxD, w_Dxvocab, targets_BxQ, chunk, compute_dtype)[0]


def _forward(h_BxQxD, w_Dxvocab, targets_BxQ, chunk, compute_dtype):
  from moejax.train.loss import _tile_logits, _tile_loss, _tiles
  h_n, t_n = _tiles(h_BxQxD, targets_BxQ, chunk)

  def tile(total, xs):
    h, t = xs
    loss, lse_Bxtile = _tile_loss(_tile_logits(h, w_Dxvocab, compute_dtype), t)
    return total + loss, lse_Bxtile

  total, lse_n = jax.lax.scan(tile, jnp.zeros((), jnp.float32), (h_n, t_n))
  return total / targets_BxQ.size, (h_BxQxD, w_Dxvocab, targets_BxQ, lse_n)


def _bwd(chunk, compute_dtype, res, g):
  from moejax.train.loss import _tile_grads, _tile_logits, _tiles
  h_BxQxD, w_Dxvocab, targets_BxQ, lse_n = res
  h_n, t_n = _tiles(h_BxQxD, targets_BxQ, chunk)
  scale = g / targets_BxQ.size

  def tile(dw_Dxvocab, xs):
    h, t, lse_Bxtile = xs
    logits = _tile_logits(h, w_Dxvocab, compute_dtype)    # recomputed: the old path's cost
    dh, dw = _tile_grads(h, t, logits, lse_Bxtile, w_Dxvocab, scale, compute_dtype)
    return dw_Dxvocab + dw, dh

  dw, dh_n = jax.lax.scan(tile, jnp.zeros(w_Dxvocab.shape, jnp.float32), (h_n, t_n, lse_n))
  batch, length, d_model = h_BxQxD.shape
  dh = dh_n.swapaxes(0, 1).reshape(batch, -1, d_model)[:, :length]
  return dh.astype(h_BxQxD.dtype), dw.astype(w_Dxvocab.dtype), None


recompute_tiled_cross_entropy.defvjp(_forward, _bwd)


def pipelined_microbatches():
  """The train step's microbatches as the differentiated pipeline of one stage."""
  from moejax.model.pipeline import Pipelined
  from moejax.train import step

  def pipelined(params, model, moe_cfg, batch_BxQ1, layout, microbatches):
    return jax.value_and_grad(step.loss_fn, has_aux=True)(
        params, Pipelined(model, microbatches), moe_cfg, batch_BxQ1, layout)
  return _swapped([(step, "accumulated_loss_and_grads", pipelined)])
