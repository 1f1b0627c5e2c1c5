"""The pure train and eval steps: (state, batch, layout) -> (state, metrics)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from moejax.config import MoEConfig
from moejax.layout.tables import Layout
from moejax.train.loss import head_loss
from moejax.train.state import TrainState


def loss_fn(params, model: nn.Module, moe_cfg: MoEConfig, batch_BxQ1: jax.Array,
            layout: Layout):
  inputs, targets = batch_BxQ1[:, :-1], batch_BxQ1[:, 1:]
  head, stats = model.apply({"params": params}, inputs, layout)
  ce = head_loss(model.cfg)(head, targets)     # model.cfg: a Transformer's, or a Pipelined's
  balance = jnp.sum(stats.balance_loss)
  z = jnp.sum(stats.z_loss)
  loss = ce + moe_cfg.balance_loss_weight * balance + moe_cfg.z_loss_weight * z
  return loss, {"ce": ce, "balance_loss_L": stats.balance_loss, "z_loss_L": stats.z_loss,
                "counts_LxWxE": stats.counts_WxE, "dropped_LxW": stats.dropped_W,
                "slot_counts_LxWxS": stats.slot_counts_WxS,
                # after capacity: rows each device computed per source, and its drops
                "received_LxWxN": stats.received_WxN, "overflow_LxW": stats.overflow_W}


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
               tx: optax.GradientTransformation, moe_cfg: MoEConfig, lr_schedule):
  """One AdamW step. A non-finite loss or gradient norm keeps the old params and optimizer
  state (a data-dependent select, same program) and reports `skipped`; `step` advances."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, aux), grads = grad_fn(state.params, model, moe_cfg, batch_BxQ1,
                               biased_layout(layout, state.router_bias_LxE))
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
              moe_cfg: MoEConfig):
  _, aux = loss_fn(params, model, moe_cfg, batch_BxQ1, layout)
  return aux["ce"]
