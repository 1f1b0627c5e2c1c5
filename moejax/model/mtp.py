"""Multi-token prediction, one extra depth (DeepSeek-V3, arXiv:2412.19437 section 2.2).

At position i the module combines the main model's final (normed) hidden state h_i with the
embedding of the next token t_{i+1}: h'_i = W [RMSNorm(emb(t_{i+1})); RMSNorm(h_i)] (the
order transformers and vLLM read DeepSeek's `eh_proj` in), runs one transformer block on the
h' (causal attention over the positions, then the MoE block with its shared experts), normalises,
and predicts t_{i+2} through the main model's unembedding. Embedding and unembedding are the
main model's (shared); the loss (moejax.train.step) is the cross-entropy of t_{i+2} at the
positions that have one, times `model.mtp_loss_weight`. Inference never runs it.

The block's MoE layer computes like the model's (same dispatch and kernels, experts over the
`expert` axis, F over `model`) under a fixed layout: expert e on device e // (E/N), never
re-placed, and its routing bias is held as converted (zeros from scratch): the trainer's
balancing bias, planners, balance line and traces cover the main model's MoE layers only.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from moejax.config import ConfigError, ModelConfig, MoEConfig
from moejax.layout.tables import static_layout
from moejax.model.moe.layer import MoELayer


class MultiTokenPrediction(nn.Module):
  """(normed hidden_BxQxD, balance loss, z-loss) of the depth-1 module; `norm`, `attention`
  and `mlp` are the main model's block classes (RMSNorm, its attention, its SwiGLU)."""
  cfg: ModelConfig
  moe_cfg: MoEConfig
  mesh: Mesh
  norm: Any
  attention: Any
  mlp: Any

  @nn.compact
  def __call__(self, h_BxQxD: jax.Array, next_embed_BxQxD: jax.Array):
    cfg, moe_cfg = self.cfg, self.moe_cfg
    d, dtype, eps = cfg.d_model, jnp.dtype(cfg.dtype), cfg.norm_eps
    w = self.param("eh_proj", nn.with_logical_partitioning(
        nn.initializers.normal((2 * d) ** -0.5), (None, "embed")), (2 * d, d), jnp.float32)
    both = jnp.concatenate([self.norm(eps, name="enorm")(next_embed_BxQxD),
                            self.norm(eps, name="hnorm")(h_BxQxD)], axis=-1)
    x = both.astype(dtype) @ w.astype(dtype)
    x = x + self.attention(cfg, name="attn")(self.norm(eps, name="ln_attn")(x))
    h = self.norm(eps, name="ln_moe")(x)
    num_dev = self.mesh.shape["expert"]
    if moe_cfg.num_experts % num_dev:
      raise ConfigError(f"model.mtp_depth=1 places its MoE layer's moe.num_experts="
                        f"{moe_cfg.num_experts} experts statically over mesh.expert={num_dev} "
                        "devices; use a mesh.expert dividing it or model.mtp_depth = 0.")
    layout = jax.tree.map(lambda a: a[0], static_layout(1, moe_cfg.num_experts, num_dev))
    bias = self.param("router_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                  (None,)),
                      (moe_cfg.num_experts,), jnp.float32)
    layout = layout.replace(router_bias_LxE=jax.lax.stop_gradient(bias))
    # not named `moe`: its experts stay in expert-id order, outside ep's slot migrations
    y, stats = MoELayer(moe_cfg, self.mesh, dtype, name="routed")(h, layout)
    if moe_cfg.num_shared_experts:
      width = moe_cfg.num_shared_experts * (moe_cfg.shared_d_ff or moe_cfg.d_ff)
      y = y + self.mlp(cfg, width, name="shared")(h)
    return self.norm(eps, name="norm")(x + y), stats.balance_loss, stats.z_loss
