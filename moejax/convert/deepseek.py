"""The DeepSeek-V3 architecture (`DeepseekV3ForCausalLM`: DeepSeek-V3, Kimi K2, Moonlight):
config keys and tensor names.

The first `first_k_dense_replace` layers are dense (moejax's `moe.first_dense`), the others
MoE with `n_shared_experts` shared experts beside the routed ones; attention is multi-head
latent attention (moejax.model.mla); the router scores by sigmoid, chooses with its
`e_score_correction_bias` (moejax's `TrainState.router_bias_LxE`, in and out with the weights)
among its `topk_group` best of `n_group` groups, and scales the renormalised gates by
`routed_scaling_factor`. A multi-token prediction layer, where the checkpoint holds one, is
layer `num_hidden_layers` (moejax.model.mtp; its embedding and head copies are the main
model's, skipped on the way in and written from the main model on the way out).

DeepSeek lays each rotary part out in neighbouring pairs (`rope_interleave`, true when the key
is absent, as in the published configs); moejax rotates halves, so the rotary rows of the
query and of the shared key are permuted on the way in (evens, then odds) and back on the way
out: the same scores, and the same tensors bit for bit after a round trip.
"""

from __future__ import annotations

import numpy as np

from moejax.config import ConfigError

TYPES = ("deepseek_v3", "kimi_k2")   # Kimi K2 publishes its own model_type, V3's architecture
BIAS = "router_bias_LxE"             # the train state's field the router's bias fills


def _rope(hf: dict, max_len: int) -> dict:
  """moejax's RoPE fields of a config.json: `rope_parameters` (transformers 5) or the
  published `rope_scaling` (with `rope_theta` beside it)."""
  params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return {"rope_base": theta}
  if kind != "yarn":
    raise ConfigError(f"config.json asks for RoPE scaling {kind!r}; moejax computes plain RoPE "
                      "and YaRN for this architecture.")
  for key, fine in (("attention_factor", None), ("truncate", True)):
    if params.get(key, fine) != fine:
      raise ConfigError(f"config.json's YaRN has {key}={params[key]!r}; moejax computes YaRN "
                        f"with {key}={fine!r} (DeepSeek's).")
  original = int(params.get("original_max_position_embeddings") or max_len)
  return {"rope_base": theta, "rope_scaling": "yarn",
          "rope_factor": float(params.get("factor") or max_len / original),
          "rope_original_max_len": original,
          "rope_beta_fast": float(params.get("beta_fast") or 32),
          "rope_beta_slow": float(params.get("beta_slow") or 1),
          "rope_mscale": float(params.get("mscale") or 0.0),
          "rope_mscale_all_dim": float(params.get("mscale_all_dim") or 0.0)}


def _refuse(hf: dict) -> None:
  checks = (("scoring_func", "sigmoid", "sigmoid router scores"),
            ("topk_method", "noaux_tc", "V3's choice (bias-corrected scores by groups)"),
            ("moe_layer_freq", 1, "an MoE block in every layer after the dense ones"),
            ("hidden_act", "silu", "SwiGLU with SiLU"),
            ("tie_word_embeddings", False, "untied input and output embeddings"),
            ("attention_bias", False, "attention without biases"))
  for key, want, what in checks:
    if hf.get(key) not in (None, want):
      raise ConfigError(f"config.json has {key}={hf[key]!r}; moejax computes {what} "
                        f"({key}={want!r}), so the converted model would differ.")
  depth = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
  if depth > 1:
    raise ConfigError(f"config.json has num_nextn_predict_layers={depth}; moejax predicts one "
                      "extra token: convert a checkpoint with at most one MTP layer.")


def moe_config(hf: dict, mtp: bool) -> tuple[dict, dict]:
  """(model fields, moe fields) of a DeepSeek-V3-architecture config.json; `mtp`: the
  checkpoint holds its multi-token prediction layer."""
  _refuse(hf)
  max_len = hf["max_position_embeddings"]
  model = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"], max_seq_len=max_len,
      norm_eps=float(hf["rms_norm_eps"]), kv_lora_rank=hf["kv_lora_rank"],
      q_lora_rank=hf.get("q_lora_rank") or 0, qk_nope_head_dim=hf["qk_nope_head_dim"],
      qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
      mtp_depth=1 if mtp else 0, **_rope(hf, max_len))
  width = hf["moe_intermediate_size"]
  moe = dict(
      num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
      top_k=hf["num_experts_per_tok"], d_ff=width, moe_every=1,
      first_dense=hf.get("first_k_dense_replace") or 0,
      num_shared_experts=hf.get("n_shared_experts") or 0, shared_d_ff=width,
      normalize_top_k=bool(hf.get("norm_topk_prob", True)), gate="sigmoid",
      route_scale=float(hf.get("routed_scaling_factor") or 1.0),
      n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
      # DeepSeek-V3's sequence-wise balance loss is moejax's sigmoid one; the bias stays as
      # published (its last phase trained with the bias rate at 0): moe.bias_rate resumes it
      balance_loss_weight=float(hf.get("aux_loss_alpha") or 0.0), z_loss_weight=0.0,
      bias_rate=0.0)
  return model, moe


def hf_config(model, moe, dtype: str, template: dict | None) -> dict:
  """A config.json: `template` (the converted model's own) with moejax's shape fields, or
  DeepseekV3's keys; no quantization (the weights leave unquantised)."""
  out = dict(template or {})
  out.pop("quantization_config", None)
  out.update({
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": out.get("model_type",
                                                                        "deepseek_v3"),
      "vocab_size": model.vocab_size, "hidden_size": model.d_model,
      "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
      "num_key_value_heads": model.num_heads, "intermediate_size": model.d_ff,
      "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm_eps,
      "kv_lora_rank": model.kv_lora_rank, "q_lora_rank": model.q_lora_rank or None,
      "qk_nope_head_dim": model.qk_nope_head_dim, "qk_rope_head_dim": model.qk_rope_head_dim,
      "v_head_dim": model.v_head_dim, "n_routed_experts": moe.num_experts,
      "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.d_ff,
      "first_k_dense_replace": moe.first_dense, "n_shared_experts": moe.num_shared_experts,
      "norm_topk_prob": moe.normalize_top_k, "routed_scaling_factor": moe.route_scale,
      "n_group": moe.n_group, "topk_group": moe.topk_group, "hidden_act": "silu",
      "tie_word_embeddings": False, "num_nextn_predict_layers": model.mtp_depth,
      "rope_interleave": interleaved(template), "dtype": dtype})
  for key in ("torch_dtype", "num_local_experts", "num_mtp_layers", "rope_theta",
              "rope_scaling"):
    out.pop(key, None)
  params = {"rope_type": "default", "rope_theta": model.rope_base}
  if model.rope_scaling == "yarn":
    params.update(rope_type="yarn", factor=model.rope_factor,
                  original_max_position_embeddings=model.rope_original_max_len or
                  model.max_seq_len, beta_fast=model.rope_beta_fast,
                  beta_slow=model.rope_beta_slow)
    for key, value in (("mscale", model.rope_mscale), ("mscale_all_dim",
                                                       model.rope_mscale_all_dim)):
      if value:
        params[key] = value
  out["rope_parameters"] = params
  return out


def interleaved(hf: dict | None) -> bool:
  """Whether the checkpoint's rotary parts are in neighbouring pairs (DeepSeek's layout)."""
  return bool((hf or {}).get("rope_interleave", True))


def _halves(rot: int) -> np.ndarray:
  """Row j of the halves layout is row `_halves(rot)[j]` of the pairs layout."""
  return np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2)])


def _attention(names: dict, p: str, leaf: tuple, index: tuple, model, interleave: bool):
  nope, rot, rank = model.qk_nope_head_dim, model.qk_rope_head_dim, model.kv_lora_rank
  q_how = ("q_heads", nope, rot) if interleave else "in_heads"
  a = p + "self_attn."
  if model.q_lora_rank:
    names[a + "q_a_proj.weight"] = (leaf + ("wq_a",), index, "T")
    names[a + "q_a_layernorm.weight"] = (leaf + ("q_norm", "scale"), index, "copy")
    names[a + "q_b_proj.weight"] = (leaf + ("wq_b",), index, q_how)
  else:
    names[a + "q_proj.weight"] = (leaf + ("wq",), index, q_how)
  names[a + "kv_a_proj_with_mqa.weight"] = (leaf + ("wkv_a",), index,
                                            ("kv_a", rank, rot) if interleave else "T")
  names[a + "kv_a_layernorm.weight"] = (leaf + ("kv_norm", "scale"), index, "copy")
  names[a + "kv_b_proj.weight"] = (leaf + ("wkv_b",), index, "in_heads")
  names[a + "o_proj.weight"] = (leaf + ("wo",), index, "out_heads")


def _swiglu(names: dict, p: str, leaf: tuple, index: tuple) -> None:
  for hf_name, w in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
    names[f"{p}{hf_name}.weight"] = (leaf + (w,), index, "T")


def _moe(names, p, moe, layer: tuple, experts: tuple, bias: tuple, shared: tuple) -> None:
  names[p + "mlp.gate.weight"] = (experts + ("router",), layer, "T")
  names[p + "mlp.gate.e_score_correction_bias"] = (bias, layer, "copy")
  for e in range(moe.num_experts):
    _swiglu(names, f"{p}mlp.experts.{e}.", experts, layer + (e,))
  if moe.num_shared_experts:
    _swiglu(names, p + "mlp.shared_experts.", shared, layer)


def tensor_names(model, moe, interleave: bool = True) -> dict[str, tuple]:
  """{HF tensor name: (moejax leaf, index, how)} as `families.tensor_names`; the router bias's
  leaf is the train state's `router_bias_LxE`; `how` 'dup:...' marks a copy of another
  tensor (skipped on the way in, written from its leaf on the way out)."""
  names = {"model.embed_tokens.weight": (("embed",), (), "copy"),
           "lm_head.weight": (("unembed",), (), "T"),
           "model.norm.weight": (("ln_final", "scale"), (), "copy")}
  k = moe.first_dense
  for i in range(model.num_layers):
    p = f"model.layers.{i}."
    if i < k:
      names[p + "input_layernorm.weight"] = ((f"first_ln_attn_{i}", "scale"), (), "copy")
      names[p + "post_attention_layernorm.weight"] = ((f"first_ln_mlp_{i}", "scale"), (),
                                                      "copy")
      _attention(names, p, (f"first_attn_{i}",), (), model, interleave)
      _swiglu(names, p + "mlp.", (f"first_mlp_{i}",), ())
      continue
    layer = (i - k,)
    names[p + "input_layernorm.weight"] = (("layers", "ln_attn_moe", "scale"), layer, "copy")
    names[p + "post_attention_layernorm.weight"] = (("layers", "ln_moe", "scale"), layer, "copy")
    _attention(names, p, ("layers", "attn_moe"), layer, model, interleave)
    _moe(names, p, moe, layer, ("layers", "moe"), (BIAS,), ("layers", "shared"))
  if model.mtp_depth:
    p = f"model.layers.{model.num_layers}."
    for hf_name, leaf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("input_layernorm", "ln_attn"),
                          ("post_attention_layernorm", "ln_moe"), ("shared_head.norm", "norm")):
      names[f"{p}{hf_name}.weight"] = (("mtp", leaf, "scale"), (), "copy")
    names[p + "eh_proj.weight"] = (("mtp", "eh_proj"), (), "T")
    names[p + "embed_tokens.weight"] = (("embed",), (), "dup:copy")
    names[p + "shared_head.head.weight"] = (("unembed",), (), "dup:T")
    _attention(names, p, ("mtp", "attn"), (), model, interleave)
    _moe(names, p, moe, (), ("mtp", "routed"), ("mtp", "router_bias"), ("mtp", "shared"))
  return names


def to_leaf(x: np.ndarray, how: tuple, shape: tuple) -> np.ndarray:
  """The rotary permutations (`how` ('q_heads', nope, rot) or ('kv_a', rank, rot)): pairs ->
  halves, then the plain reshapes of `families.to_leaf`."""
  kind, keep, rot = how
  if kind == "q_heads":       # [heads*(nope+rot), in] -> [in, heads, nope+rot]
    y = x.reshape(shape[1], keep + rot, shape[0])
    y = np.concatenate([y[:, :keep], y[:, keep:][:, _halves(rot)]], axis=1)
    return y.transpose(2, 0, 1)
  # 'kv_a': [rank+rot, D] -> [D, rank+rot]
  return np.concatenate([x[:keep], x[keep:][_halves(rot)]], axis=0).T


def from_leaf(y: np.ndarray, how: tuple) -> np.ndarray:
  kind, keep, rot = how
  back = np.argsort(_halves(rot))
  if kind == "q_heads":       # [in, heads, nope+rot] -> [heads*(nope+rot), in]
    x = y.transpose(1, 2, 0)
    x = np.concatenate([x[:, :keep], x[:, keep:][:, back]], axis=1)
    return x.reshape(-1, y.shape[0])
  x = y.T
  return np.concatenate([x[:keep], x[keep:][back]], axis=0)


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """A block-quantised weight [out, in] (float8) times its per-block scale [ceil(out / b0),
  ceil(in / b1)], as DeepSeek's `weight_dequant` does: float32."""
  out_dim, in_dim = w.shape
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], 0), block[1], 1)
  return w.astype(np.float32) * scale[:out_dim, :in_dim]
