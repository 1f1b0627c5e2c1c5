"""Multi-head latent attention and YaRN (moejax.model.mla, moejax.model.rope) against a float64
numpy reference written from their definitions (DeepSeek-V2/V3, YaRN): with and without the
low-rank query, plain and YaRN rotary; the softmax factor at DeepSeek-V3's published
scaling; bad widths stop with one line. (Against transformers' own DeepSeek-V3 attention:
tests/test_convert_deepseek.py, with the hf extra.)"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError, ModelConfig, MoEConfig
from moejax.model import rope as rope_lib
from moejax.model.mla import MLAttention, xla_attention
from tests.numerics import assert_close

B, Q = 2, 16
MLA = ModelConfig(d_model=32, num_heads=4, kv_lora_rank=24, q_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=12, max_seq_len=32, attention="xla")
YARN = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=8, rope_mscale=0.7,
            rope_mscale_all_dim=1.0)


def yarn_frequencies(dim, base, factor, original, beta_fast, beta_slow):
  """YaRN's frequencies in float64: a pair of dims rotating fewer than beta_slow times over
  the original length is interpolated (frequency / factor), more than beta_fast kept, with a
  linear ramp over the (floored, ceiled) dims between."""
  freq = base ** (-np.arange(0, dim, 2) / dim)
  dim_of = lambda rot: dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
  low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), dim - 1)
  ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
  return freq / factor * ramp + freq * (1 - ramp)


def mscale(s, m):
  return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1


def reference(p, x, cfg):
  """The attention written out in float64: latents, norms, the per-head expansion, rotary on
  the split-off parts (the key's one rotary part for every head), causal softmax."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x, np.float64)
  nope, rot, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
  rms = lambda v, s: v / np.sqrt(np.mean(v * v, -1, keepdims=True) + cfg.norm_eps) * s
  if cfg.q_lora_rank:
    q = np.einsum("bqr,rhj->bqhj", rms(x @ p["wq_a"], p["q_norm"]["scale"]), p["wq_b"])
  else:
    q = np.einsum("bqd,dhj->bqhj", x, p["wq"])
  latent = x @ p["wkv_a"]
  kv = np.einsum("bqr,rhw->bqhw", rms(latent[..., :rank], p["kv_norm"]["scale"]), p["wkv_b"])
  if cfg.rope_scaling == "yarn":
    freq = yarn_frequencies(rot, cfg.rope_base, cfg.rope_factor, cfg.rope_original_max_len,
                            cfg.rope_beta_fast, cfg.rope_beta_slow)
    f, m, m_all = cfg.rope_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
    on_angles, on_softmax = mscale(f, m) / mscale(f, m_all), mscale(f, m_all) ** 2
  else:
    freq, on_angles, on_softmax = cfg.rope_base ** (-np.arange(0, rot, 2) / rot), 1.0, 1.0
  angle = np.arange(Q)[:, None] * freq[None]
  cos, sin = on_angles * np.cos(angle)[:, None], on_angles * np.sin(angle)[:, None]

  def rotate(v):     # pairs (i, i + rot / 2)
    a, b = v[..., :rot // 2], v[..., rot // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

  k_rot = np.broadcast_to(rotate(latent[..., None, rank:]), q[..., nope:].shape)
  q = np.concatenate([q[..., :nope], rotate(q[..., nope:])], -1)
  k = np.concatenate([kv[..., :nope], k_rot], -1)
  scores = np.einsum("bqhj,bkhj->bhqk", q, k) * (nope + rot) ** -0.5 * on_softmax
  scores = np.where(np.tril(np.ones((Q, Q), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bqhv,hvd->bqd", np.einsum("bhqk,bkhv->bqhv", probs, kv[..., nope:]), p["wo"])


def random_params(cfg, seed=0):
  x = jnp.zeros((B, Q, cfg.d_model))
  shapes = jax.eval_shape(lambda: nn.meta.unbox(MLAttention(cfg).init(jax.random.key(0), x)))
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, s: (1 + 0.2 * rng.normal(size=s.shape) if "norm" in jax.tree_util.keystr(path)
                       else 0.3 * rng.normal(size=s.shape)).astype(np.float32),
      shapes["params"])


@pytest.mark.parametrize("q_lora_rank", [16, 0], ids=["q-latent", "q-full"])
@pytest.mark.parametrize("scaling", ["none", "yarn"])
def test_mla_equals_its_definition(q_lora_rank, scaling):
  cfg = dataclasses.replace(MLA, q_lora_rank=q_lora_rank, **(YARN if scaling == "yarn" else {}))
  cfg.validate(MoEConfig())
  p = random_params(cfg)
  x = np.random.default_rng(1).normal(size=(B, Q, cfg.d_model)).astype(np.float32)
  got = jax.jit(MLAttention(cfg).apply)({"params": p}, x)
  want = reference(p, x, cfg)
  assert got.shape == (B, Q, cfg.d_model)
  # reductions: the latents (D), the norms, the expansions (ranks), scores (J), values (Q),
  # output (H * V)
  n = 2 * cfg.d_model + cfg.q_lora_rank + cfg.kv_lora_rank + 24 + Q + cfg.num_heads * 12
  assert_close(got, want, n)


def test_causal_mask_keeps_only_the_softmaxs_residuals():
  """XLA's attention keeps two [B, heads, Q, Q] residuals for its backward (the softmax's
  scores and weights), none for the causal mask, which a `where` would add (its predicate
  and fill, which XLA held live through a whole 671B step); masked or not, the outputs equal
  the `where`'s."""
  h, j, v_dim = 3, 6, 4
  q, k = (jax.random.normal(jax.random.key(i), (B, Q, h, j)) for i in (1, 2))
  v = jax.random.normal(jax.random.key(3), (B, Q, h, v_dim))
  out, vjp = jax.vjp(lambda *a: xla_attention(*a, 0.3), q, k, v)
  square = [leaf for leaf in jax.tree.leaves(vjp) if getattr(leaf, "shape", ())[-2:] == (Q, Q)]
  assert [leaf.dtype for leaf in square] == [jnp.float32, jnp.float32], square
  logits = jnp.einsum("bqhj,bkhj->bhqk", q, k) * 0.3
  logits = jnp.where(jnp.tril(jnp.ones((Q, Q), jnp.bool_)), logits, jnp.finfo(jnp.float32).min)
  want = jnp.einsum("bhqk,bkhv->bqhv", jax.nn.softmax(logits, axis=-1), v)
  np.testing.assert_array_equal(out, want)


def test_yarn_frequencies_and_factors():
  """The frequencies (float32, as transformers computes them) equal YaRN's within float32;
  DeepSeek-V3's published scaling (factor 40, mscale 1 and 1) leaves cos and sin alone and
  scales the softmax by (0.1 ln 40 + 1)^2."""
  cfg = dataclasses.replace(MLA, rope_scaling="yarn", rope_factor=40.0,
                            rope_original_max_len=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                            max_seq_len=163840)
  got = rope_lib.inv_frequencies(cfg, 64)
  want = yarn_frequencies(64, 10000.0, 40.0, 4096, 32, 1)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=4 * np.finfo(np.float32).eps)
  assert want[0] == 1 and want[-1] < want[0] / 40   # kept at the top, interpolated below
  assert rope_lib.attention_factors(cfg) == (1.0, (0.1 * math.log(40) + 1) ** 2)


@pytest.mark.parametrize("change, match", [
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7"), (dict(v_head_dim=0), "v_head_dim=0"),
    (dict(kv_lora_rank=0, rope_scaling="yarn"), "multi-head latent attention only"),
    (dict(rope_scaling="ntk"), "rope_scaling='ntk'"), (dict(mtp_depth=2), "mtp_depth=2")])
def test_latent_settings_are_checked(change, match):
  with pytest.raises(ConfigError, match=match) as e:
    dataclasses.replace(MLA, **change).validate(MoEConfig())
  assert "\n" not in str(e.value)
