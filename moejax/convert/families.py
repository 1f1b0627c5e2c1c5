"""The Hugging Face model families moejax reads and writes: config keys and tensor names.

Mixtral, Qwen3-MoE and OLMoE are decoders of pre-norm blocks (RMSNorm, RoPE attention, a
softmax top-k MoE of SwiGLU experts in every layer) with untied embeddings; they differ in
tensor names, where the QK-norm sits and whether the k gates are renormalised. The
DeepSeek-V3 architecture (DeepSeek-V3, Kimi K2, Moonlight) has its own module
(moejax.convert.deepseek). `moe_config` maps a `config.json` onto moejax's config fields and
refuses (one line) what moejax does not compute the same way.
"""

from __future__ import annotations

import dataclasses

from moejax.config import ConfigError
from moejax.convert import deepseek


@dataclasses.dataclass(frozen=True)
class Family:
  model_type: str
  architecture: str
  moe: str                       # the MoE block's module name in a layer
  experts: tuple[str, str, str]  # gate, up, down projections of an expert
  experts_key: str               # config key of the expert count
  width_key: str                 # config key of an expert's hidden width
  qk_norm: str                   # moejax's model.qk_norm
  topk_key: str | None           # config key of the k-gate renormalisation (None: always on)


FAMILIES = {f.model_type: f for f in (
    Family("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"),
           "num_local_experts", "intermediate_size", "none", None),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
           "num_experts", "moe_intermediate_size", "head", "norm_topk_prob"),
    Family("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
           "num_experts", "intermediate_size", "proj", "norm_topk_prob"),
) + tuple(Family(kind, "DeepseekV3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                 "n_routed_experts", "moe_intermediate_size", "none", "norm_topk_prob")
          for kind in deepseek.TYPES)}


def is_deepseek(fam: Family) -> bool:
  return fam.model_type in deepseek.TYPES


def family_of(hf: dict) -> Family:
  kind = hf.get("model_type")
  if kind not in FAMILIES:
    raise ConfigError(f"config.json has model_type={kind!r}; moejax converts "
                      f"{', '.join(sorted(FAMILIES))}.")
  return FAMILIES[kind]


def rope_theta(hf: dict) -> float:
  """RoPE base of a config.json (transformers 5 nests it in rope_parameters)."""
  params = hf.get("rope_parameters") or {}
  kind = params.get("rope_type", "default")
  if kind != "default" or hf.get("rope_scaling"):
    raise ConfigError(f"config.json asks for RoPE scaling {kind!r}; moejax computes plain RoPE "
                      "only: convert a model without rope_scaling.")
  return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _refuse_unsupported(hf: dict) -> None:
  checks = (
      ("hidden_act", "silu", "SwiGLU experts with SiLU"),
      ("tie_word_embeddings", False, "untied input and output embeddings"),
      ("attention_bias", False, "attention without biases"),
      ("clip_qkv", None, "unclipped q, k, v"),
      ("mlp_only_layers", [], "an MoE block in every layer"),
      ("decoder_sparse_step", 1, "an MoE block in every layer"),
      ("use_sliding_window", False, "full causal attention"),
      ("router_jitter_noise", 0.0, "a router without jitter"),
  )
  for key, want, what in checks:
    if key in hf and hf[key] != want and hf[key] is not None:
      raise ConfigError(f"config.json has {key}={hf[key]!r}; moejax computes {what} "
                        f"({key}={want!r}), so the converted model would differ.")
  if hf.get("model_type") == "mixtral" and hf.get("sliding_window"):
    raise ConfigError(f"config.json has sliding_window={hf['sliding_window']}; moejax computes "
                      "full causal attention: set it to null if the model never saw longer "
                      "sequences, or convert another model.")


def moe_config(hf: dict, mtp: bool = False) -> tuple[dict, dict]:
  """(model fields, moe fields) of moejax for a config.json (dicts of field -> value); `mtp`:
  the checkpoint holds a multi-token prediction layer (DeepSeek-V3's)."""
  fam = family_of(hf)
  if is_deepseek(fam):
    return deepseek.moe_config(hf, mtp)
  _refuse_unsupported(hf)
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or d // heads
  # transformers 5 writes num_local_experts for every family; published configs use either.
  experts = hf.get(fam.experts_key) or hf["num_local_experts"]
  model = dict(
      vocab_size=hf["vocab_size"], d_model=d, num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=0 if head_dim * heads == d else head_dim, qk_norm=fam.qk_norm,
      d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
      rope_base=rope_theta(hf), norm_eps=float(hf["rms_norm_eps"]))
  top_k, layers = hf["num_experts_per_tok"], hf["num_hidden_layers"]
  # transformers' balance loss is one over all layers' choices together, its shares summed over
  # the k choices: k times moejax's per-layer loss, which moejax sums over the layers. So
  # coef * k / layers puts moejax's at the same scale (the same function only for one layer).
  moe = dict(
      num_experts=experts, top_k=top_k,
      d_ff=hf[fam.width_key],
      normalize_top_k=True if fam.topk_key is None else bool(hf.get(fam.topk_key, False)),
      moe_every=1, gate="softmax",
      balance_loss_weight=float(hf.get("router_aux_loss_coef", 0.0)) * top_k / layers,
      z_loss_weight=float(hf.get("router_z_loss_coef", 0.0)))
  return model, moe


def hf_config(fam: Family, model, moe, dtype: str, template: dict | None = None) -> dict:
  """A config.json for moejax's `model` / `moe` configs (ModelConfig, MoEConfig): `template`
  (the converted model's own config.json) with the shape fields set, or the family's keys."""
  if is_deepseek(fam):
    return deepseek.hf_config(model, moe, dtype, template)
  out = dict(template or {})
  head_dim = model.head_dim or model.d_model // model.num_heads
  out.update({
      "architectures": [fam.architecture], "model_type": fam.model_type,
      "vocab_size": model.vocab_size, "hidden_size": model.d_model,
      "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
      "num_key_value_heads": model.num_kv_heads or model.num_heads,
      "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm_eps,
      "num_experts_per_tok": moe.top_k, "hidden_act": "silu", "tie_word_embeddings": False,
      "dtype": dtype, "intermediate_size": model.d_ff, fam.width_key: moe.d_ff,
  })
  experts_key = "num_local_experts" if "num_local_experts" in out else fam.experts_key
  out[experts_key] = moe.num_experts
  if fam.topk_key:
    out[fam.topk_key] = moe.normalize_top_k
  if template is None or "head_dim" in out:
    out["head_dim"] = head_dim
  params = dict(out.get("rope_parameters") or {}, rope_type="default", rope_theta=model.rope_base)
  out["rope_parameters"] = params
  out.pop("rope_theta", None)
  return out


def tensor_names(fam: Family, num_layers: int, num_experts: int, model=None, moe=None,
                 interleave: bool = True) -> dict[str, tuple]:
  """{HF tensor name: (moejax leaf, index, how)}: the leaf is a canonical (ep, expert-id order)
  param path, `index` the layer (and expert) it fills, `how` the reshape rule (see `to_leaf`).
  DeepSeek-V3's names need the `model` and `moe` configs and the rotary layout."""
  if is_deepseek(fam):
    return deepseek.tensor_names(model, moe, interleave)
  names = {"model.embed_tokens.weight": (("embed",), (), "copy"),
           "lm_head.weight": (("unembed",), (), "T"),
           "model.norm.weight": (("ln_final", "scale"), (), "copy")}
  gate, up, down = fam.experts
  for i in range(num_layers):
    p = f"model.layers.{i}."
    names[p + "input_layernorm.weight"] = (("layers", "ln_attn_moe", "scale"), (i,), "copy")
    names[p + "post_attention_layernorm.weight"] = (("layers", "ln_moe", "scale"), (i,), "copy")
    for w in ("q", "k", "v"):
      names[p + f"self_attn.{w}_proj.weight"] = (("layers", "attn_moe", f"w{w}"), (i,), "in_heads")
    names[p + "self_attn.o_proj.weight"] = (("layers", "attn_moe", "wo"), (i,), "out_heads")
    if fam.qk_norm != "none":
      for w in ("q", "k"):
        names[p + f"self_attn.{w}_norm.weight"] = (
            ("layers", "attn_moe", f"{w}_norm", "scale"), (i,), "reshape")
    names[p + f"{fam.moe}.gate.weight"] = (("layers", "moe", "router"), (i,), "T")
    for e in range(num_experts):
      q = p + f"{fam.moe}.experts.{e}."
      names[q + f"{gate}.weight"] = (("layers", "moe", "w_gate"), (i, e), "T")
      names[q + f"{up}.weight"] = (("layers", "moe", "w_up"), (i, e), "T")
      names[q + f"{down}.weight"] = (("layers", "moe", "w_down"), (i, e), "T")
  return names


def to_leaf(x, how: str, shape: tuple):
  """An HF tensor (numpy, [out, in]) -> the moejax slice of `shape` it fills."""
  if isinstance(how, tuple):           # a rotary permutation (DeepSeek's pairs -> halves)
    return deepseek.to_leaf(x, how, shape)
  if how == "copy":
    return x
  if how == "T":
    return x.T
  if how == "in_heads":              # [heads*hdim, D] -> [D, heads, hdim]
    return x.reshape(shape[1], shape[2], shape[0]).transpose(2, 0, 1)
  if how == "out_heads":             # [D, heads*hdim] -> [heads, hdim, D]
    return x.T.reshape(shape)
  # "reshape": a norm scale [hdim] or [heads*hdim] -> [hdim] or [heads, hdim]
  return x.reshape(shape)


def from_leaf(y, how: str):
  """Inverse of `to_leaf`: a moejax slice -> the HF tensor ('dup:HOW': a copy, by HOW)."""
  if isinstance(how, tuple):
    return deepseek.from_leaf(y, how)
  how = how.removeprefix("dup:")
  if how == "copy":
    return y
  if how == "T":
    return y.T
  if how == "in_heads":              # [D, heads, hdim] -> [heads*hdim, D]
    return y.transpose(1, 2, 0).reshape(-1, y.shape[0])
  if how == "out_heads":             # [heads, hdim, D] -> [D, heads*hdim]
    return y.reshape(-1, y.shape[-1]).T
  return y.reshape(-1)
