"""The pure train and eval steps: (state, batch, layout) -> (state, metrics)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from moejax.config import MoEConfig
from moejax.layout.tables import Layout
from moejax.model.pipeline import microbatch_rows
from moejax.train.loss import head_loss
from moejax.train.state import TrainState


def loss_fn(params, model: nn.Module, moe_cfg: MoEConfig, batch_BxQ1: jax.Array,
            layout: Layout):
  inputs, targets = batch_BxQ1[:, :-1], batch_BxQ1[:, 1:]
  model_cfg = model.cfg      # a Transformer's, or a Pipelined's
  if model_cfg.mtp_depth:    # position i also predicts t_{i+2} from t_{i+1} (moejax.model.mtp)
    (head, mtp), stats = model.apply({"params": params}, inputs, layout,
                                     next_tokens_BxQ=targets)
  else:
    (head, stats), mtp = model.apply({"params": params}, inputs, layout), None
  ce_of = head_loss(model_cfg)
  ce = ce_of(head, targets)
  balance = jnp.sum(stats.balance_loss)
  z = jnp.sum(stats.z_loss)
  extra, ce_total = {}, ce
  if mtp is not None:   # the last position has no token after next
    extra["mtp_ce"] = ce_of(mtp.head._replace(h_BxQxD=mtp.head.h_BxQxD[:, :-1]),
                            batch_BxQ1[:, 2:])
    ce_total = ce + model_cfg.mtp_loss_weight * extra["mtp_ce"]
    balance, z = balance + mtp.balance_loss, z + mtp.z_loss
  loss = ce_total + moe_cfg.balance_loss_weight * balance + moe_cfg.z_loss_weight * z
  return loss, {"ce": ce, **extra, "balance_loss_L": stats.balance_loss, "z_loss_L": stats.z_loss,
                "counts_LxWxE": stats.counts_WxE, "dropped_LxW": stats.dropped_W,
                "slot_counts_LxWxS": stats.slot_counts_WxS,
                # after capacity: rows each device computed per source, and its drops
                "received_LxWxN": stats.received_WxN, "overflow_LxW": stats.overflow_W}


def accumulated_loss_and_grads(params, model: nn.Module, moe_cfg: MoEConfig,
                               batch_BxQ1: jax.Array, layout: Layout, microbatches: int):
  """`jax.value_and_grad(loss_fn, has_aux=True)` of the batch as the mean over `microbatches`
  microbatches (rows i % M == m: each device's rows of a microbatch are rows it holds), one
  forward and backward pass at a time. The gradients add into one buffer per parameter
  (`vjp.with_refs`): each layer's weight gradient is added into its row of the stacked buffer
  inside the backward layer loop, where a differentiated loop over microbatches writes each
  microbatch's layer gradients into a zero-filled stack and then adds the stack to a carried
  sum. The aux's floats are the microbatches' mean, its counts their sum."""
  parts_MxBxQ1 = microbatch_rows(batch_BxQ1, microbatches)
  grads = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)

  def microbatch(m, total):
    part_BxQ1 = jax.lax.dynamic_index_in_dim(parts_MxBxQ1, m, 0, keepdims=False)
    loss, vjp, aux = jax.vjp(
        lambda p: loss_fn(p, model, moe_cfg, part_BxQ1, layout), params, has_aux=True)
    vjp.with_refs(grads)(jnp.ones_like(loss) / microbatches)
    return jax.tree.map(
        lambda t, a: t + (a / microbatches if jnp.issubdtype(a.dtype, jnp.floating) else a),
        total, (loss, aux))

  shapes = jax.eval_shape(lambda: loss_fn(params, model, moe_cfg, parts_MxBxQ1[0], layout))
  zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return (jax.lax.fori_loop(0, microbatches, microbatch, zero),
          jax.tree.map(jax.freeze, grads))


def biased_layout(layout: Layout, router_bias_LxE: jax.Array) -> Layout:
  """The layout the model routes with: the train state's balancing bias added to the
  layout's own (zeros, or a benchmark's load injection)."""
  return layout.replace(router_bias_LxE=layout.router_bias_LxE + router_bias_LxE)


def update_bias(bias_LxE: jax.Array, counts_LxWxE: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing: bias_e += rate * sign(mean load - load_e), per layer, the load
  being the (token, k) choices of the global batch."""
  load_LxE = jnp.sum(counts_LxWxE, axis=1).astype(jnp.float32)
  return bias_LxE + rate * jnp.sign(jnp.mean(load_LxE, axis=-1, keepdims=True) - load_LxE)


def train_step(state: TrainState, batch_BxQ1: jax.Array, layout: Layout, *, model: nn.Module,
               tx: optax.GradientTransformation, moe_cfg: MoEConfig, lr_schedule,
               microbatches: int = 1):
  """One AdamW step, its gradient accumulated over `microbatches` (a Pipelined model splits
  the batch itself: 1). A non-finite loss or gradient norm keeps the old params and optimizer
  state (a data-dependent select, same program) and reports `skipped`; `step` advances."""
  layout = biased_layout(layout, state.router_bias_LxE)
  if microbatches > 1:
    (loss, aux), grads = accumulated_loss_and_grads(state.params, model, moe_cfg, batch_BxQ1,
                                                    layout, microbatches)
  else:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, aux), grads = grad_fn(state.params, model, moe_cfg, batch_BxQ1, layout)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep_new = lambda new, old: jnp.where(finite, new, old)
  params = jax.tree.map(keep_new, params, state.params)
  opt_state = jax.tree.map(keep_new, opt_state, state.opt_state)
  bias = keep_new(update_bias(state.router_bias_LxE, aux["counts_LxWxE"], moe_cfg.bias_rate),
                  state.router_bias_LxE)
  metrics = dict(aux, loss=loss, grad_norm=grad_norm, lr=lr_schedule(state.step),
                 skipped=jnp.logical_not(finite))
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                    router_bias_LxE=bias), metrics


def eval_step(params, batch_BxQ1: jax.Array, layout: Layout, *, model: nn.Module,
              moe_cfg: MoEConfig, microbatches: int = 1):
  """The batch's cross-entropy, `microbatches` rows apart at a time as the train step takes
  them (the mean of theirs: the microbatches are of one size)."""
  if microbatches == 1:
    return loss_fn(params, model, moe_cfg, batch_BxQ1, layout)[1]["ce"]
  parts_MxBxQ1 = microbatch_rows(batch_BxQ1, microbatches)
  return jax.lax.fori_loop(0, microbatches, lambda m, total: total + loss_fn(
      params, model, moe_cfg, jax.lax.dynamic_index_in_dim(parts_MxBxQ1, m, 0, keepdims=False),
      layout)[1]["ce"] / microbatches, jnp.zeros((), jnp.float32))
