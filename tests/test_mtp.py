"""Multi-token prediction (moejax.model.mtp, one extra depth): the train step's loss equals a
reference written from DeepSeek-V3's definition (h'_i = W [norm(emb(t_{i+1})); norm(h_i)],
one block, a final norm, the shared unembedding, the cross-entropy of t_{i+2} where there is
one, weighted), loss and gradients, on a mesh, and with microbatches; off by default; with
pipeline stages it stops with one line."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import Config, ConfigError, DataConfig, MeshConfig, ModelConfig, MoEConfig
from moejax.model.moe.reference import moe_reference
from moejax.model.transformer import attention_class
from moejax.train import step as step_lib
from moejax.train.loss import cross_entropy
from tests.helpers import BATCH, SEQ, tokens
from tests.moe_helpers import cached_setup, model_lengths, pipeline_reference, stage_setup
from tests.numerics import assert_close, assert_trees_close

MODEL = ModelConfig(d_model=16, num_layers=2, num_heads=2, d_ff=16, max_seq_len=16,
                    mtp_depth=1, mtp_loss_weight=0.3)
MOE = MoEConfig(num_experts=8, top_k=2, capacity_factor=8.0, d_ff=16, moe_every=1,
                gate="sigmoid", route_scale=2.5, n_group=4, topk_group=2, num_shared_experts=1,
                shared_d_ff=8, balance_loss_weight=0.01, z_loss_weight=1e-3)


def rms(x, scale, eps=MODEL.norm_eps):
  return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def mtp_reference(params, h_BxQxD, next_BxQ, after_next_BxQ1, model_cfg, moe_cfg):
  """(cross-entropy of t_{i+2}, the block's balance and z losses) from the definition: the
  block's attention is the model's own module, its MoE the single-device reference."""
  m = params["mtp"]
  e = params["embed"][next_BxQ]
  h = jnp.concatenate([rms(e, m["enorm"]["scale"]), rms(h_BxQxD, m["hnorm"]["scale"])], -1)
  x = h @ m["eh_proj"]
  x = x + attention_class(model_cfg)(model_cfg).apply({"params": m["attn"]},
                                                      rms(x, m["ln_attn"]["scale"]))
  g = rms(x, m["ln_moe"]["scale"])
  y, _, bal, z = moe_reference(m["routed"], g, moe_cfg.top_k, bias_E=m["router_bias"],
                               gate=moe_cfg.gate, route_scale=moe_cfg.route_scale,
                               num_groups=moe_cfg.n_group, topk_groups=moe_cfg.topk_group)
  s = m["shared"]
  y = y + (jax.nn.silu(g @ s["w_gate"]) * (g @ s["w_up"])) @ s["w_down"]
  logits = rms(x + y, m["norm"]["scale"]) @ params["unembed"]
  return cross_entropy(logits[:, :-1], after_next_BxQ1), bal, z


def reference_loss(params, model, batch_BxQ1, layout, model_cfg, moe_cfg):
  """The main model's loss (its own path) plus the reference module's weighted terms."""
  inputs = batch_BxQ1[:, :-1]
  (head, _), stats = model.apply({"params": params}, inputs, layout)
  h = head.h_BxQxD
  logits = h @ params["unembed"]
  ce = cross_entropy(logits, batch_BxQ1[:, 1:])
  mtp_ce, bal, z = mtp_reference(params, h, batch_BxQ1[:, 1:], batch_BxQ1[:, 2:], model_cfg,
                                 moe_cfg)
  loss = (ce + model_cfg.mtp_loss_weight * mtp_ce +
          moe_cfg.balance_loss_weight * (jnp.sum(stats.balance_loss) + bal) +
          moe_cfg.z_loss_weight * (jnp.sum(stats.z_loss) + z))
  return loss, mtp_ce


@pytest.mark.parametrize("model_cfg", [
    pytest.param(MODEL, marks=pytest.mark.slow),    # a minute on the 2-core VM
    dataclasses.replace(MODEL, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                        v_head_dim=6)], ids=["mha", "mla"])
def test_mtp_loss_equals_its_definition(model_cfg):
  _, model, _, layout, _, state = cached_setup((1, 4, 2), model_cfg, MOE)
  params = jax.tree.map(lambda a: a, state.params)
  rng = np.random.default_rng(0)    # a non-zero routing bias for the module's experts
  params["mtp"]["router_bias"] = jnp.asarray(rng.normal(0, 0.05, 8), jnp.float32)
  batch = tokens()
  step = jax.jit(jax.value_and_grad(functools.partial(
      step_lib.loss_fn, model=model, moe_cfg=MOE), has_aux=True))
  (loss, aux), grads = step(params, batch_BxQ1=batch, layout=layout)
  ref = jax.jit(jax.value_and_grad(functools.partial(
      reference_loss, model=model, layout=layout, model_cfg=model_cfg, moe_cfg=MOE),
      has_aux=True))
  (ref_loss, ref_mtp), ref_grads = ref(params, batch_BxQ1=batch)
  loss_len, grad_len = model_lengths(model_cfg, MOE)
  assert_close(aux["mtp_ce"], ref_mtp, loss_len, err_msg="mtp_ce")
  assert_close(loss, ref_loss, loss_len, err_msg="loss")
  assert float(aux["mtp_ce"]) > 0 and float(loss) > float(aux["ce"])
  assert_trees_close(grads, ref_grads, 2 * grad_len)
  assert np.abs(grads["mtp"]["eh_proj"]).max() > 0
  assert not np.any(grads["mtp"]["router_bias"])    # held as converted, not trained


def test_mtp_is_off_by_default_and_refuses_stages():
  """Stages run the model as moejax.model.pipeline, which has no multi-token head."""
  assert ModelConfig().mtp_depth == 0
  for stage, virtual in ((2, 1), (2, 2)):
    cfg = Config(mesh=MeshConfig(data=1, expert=2, stage=stage, host_device_count=2 * stage),
                 model=dataclasses.replace(MODEL, num_layers=4), moe=MOE,
                 train=dataclasses.replace(Config().train, microbatches=4,
                                           virtual_stages=virtual,
                                           pipeline_schedule=("gpipe", "circular")[virtual > 1]))
    with pytest.raises(ConfigError, match=rf"model.mtp_depth=1 runs without pipeline stages "
                       rf"\(mesh.stage={stage}, train.virtual_stages={virtual}\)"):
      cfg.validate()


def test_mtp_with_microbatches_matches_the_microbatch_by_microbatch_reference():
  """One stage's microbatches are the train step's loop (each a whole forward and backward
  pass, the multi-token head included): its loss (the weighted mtp_ce in it) and every
  gradient are the mean of the microbatches run one by one, its counts their sum, on a data x
  expert mesh."""
  model_cfg = dataclasses.replace(MODEL, kv_lora_rank=8, qk_nope_head_dim=4,
                                  qk_rope_head_dim=4, v_head_dim=6)
  cfg = Config(mesh=MeshConfig(data=2, expert=2, host_device_count=4), model=model_cfg, moe=MOE,
               data=DataConfig(seq_len=SEQ, global_batch_size=BATCH),
               train=dataclasses.replace(Config().train, microbatches=2))
  cfg.validate()
  ref_loss, ref_grads, ref_counts = pipeline_reference(model_cfg, MOE, 2)
  model, layout, state = stage_setup(model_cfg, MOE, (2, 2, 1))
  (loss, aux), grads = jax.jit(lambda p, b: step_lib.accumulated_loss_and_grads(
      p, model, MOE, b, layout, 2))(state.params, tokens())
  loss_len, grad_len = model_lengths(model_cfg, MOE)
  assert_close(loss, ref_loss, loss_len, err_msg="loss")
  assert float(aux["mtp_ce"]) > 0
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1), ref_counts)
  assert_trees_close(jax.device_get(grads), ref_grads, 2 * grad_len)
  assert np.abs(grads["mtp"]["eh_proj"]).max() > 0
