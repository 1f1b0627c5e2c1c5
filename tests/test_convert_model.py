"""The model pieces the published families need, without transformers: grouped key/value heads
(with the whole-projection QK-norm) equal multi-head attention with each k/v head repeated
over its group, and bad head settings stop with one line."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from moejax.config import Config, ConfigError, ModelConfig, MoEConfig
from moejax.model.mesh import mesh_of_shape, replicated
from moejax.model.transformer import Transformer
from moejax.train.programs import _check_split, initial_layout
from tests.helpers import BATCH, SEQ, tokens
from tests.numerics import assert_close

GQA = ModelConfig(d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=16,
                  qk_norm="proj")
MOE = MoEConfig(num_experts=8, top_k=2, capacity_factor=8.0, d_ff=32, moe_every=1)


def test_grouped_heads_equal_repeated_heads():
  """On 1 x 4 x 2 (heads over `model`): query head i reads k/v head i // 2."""
  mesh = mesh_of_shape((1, 4, 2))
  layout = jax.device_put(initial_layout(MOE, 1, 4), replicated(mesh))
  x = tokens()[:, :SEQ]
  model = Transformer(GQA, MOE, mesh)
  mha = Transformer(dataclasses.replace(GQA, num_kv_heads=0), MOE, mesh)
  shapes = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.key(0), x, layout)))
  rng = np.random.default_rng(0)   # random weights, norm scales too (no init compiled)
  params = jax.tree.map(lambda s: rng.normal(0.0, 0.3, s.shape).astype(np.float32),
                        shapes["params"])
  attn = dict(params["layers"]["attn_moe"])
  for w in ("wk", "wv"):                    # [L, D, KV, hdim] -> [L, D, heads, hdim]
    attn[w] = np.repeat(attn[w], 2, axis=2)
  # "proj" QK-norm: the mean square over repeated heads is the one over the k/v heads
  attn["k_norm"] = {"scale": np.repeat(attn["k_norm"]["scale"], 2, axis=1)}
  repeated = dict(params, layers=dict(params["layers"], attn_moe=attn))
  want = jax.jit(mha.apply)({"params": repeated}, x, layout)[0].logits()
  got = jax.jit(model.apply)({"params": params}, x, layout)[0].logits()
  assert got.shape == (BATCH, SEQ, GQA.vocab_size)
  assert_close(got, want, 8 * GQA.d_model)


@pytest.mark.parametrize("change, match", [
    (dict(num_kv_heads=3), "num_kv_heads=3"), (dict(head_dim=7), "head_dim=7"),
    (dict(num_heads=3), "num_heads=3"), (dict(qk_norm="all"), "qk_norm='all'")])
def test_head_settings_are_checked(change, match):
  with pytest.raises(ConfigError, match=match) as e:
    dataclasses.replace(GQA, **change).validate(MOE)
  assert "\n" not in str(e.value)


def test_kv_heads_must_split_over_the_model_axis():
  cfg = Config(model=GQA, moe=MOE)
  with pytest.raises(ConfigError, match="2 key/value heads .* mesh.model=4"):
    _check_split(cfg, mesh_of_shape((2, 1, 4)))
