"""`to_hf`: a moejax run dir's latest checkpoint -> safetensors shards and a config.json that
`transformers.AutoModelForCausalLM.from_pretrained` loads. DeepSeek-V3's routing bias comes from
the train state. Each tensor leaves in the dtype it came in (from_hf's record), float8 blocks in
the config's dtype (bfloat16 for a published DeepSeek-V3), never requantised.

Only the params are read (the optimizer state stays on disk), in expert-id order; tensors are
cast to the config's dtype one at a time and written as soon as a shard is full. The config is
the converted model's own config.json (kept by `from_hf` in RUN_DIR/hf, or in the run's
`train.init_from`) with moejax's shape fields, or, for a model trained from scratch, the keys
of `--family`.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np

from moejax.config import (
  CheckpointConfig,
  ConfigError,
  ModelConfig,
  MoEConfig,
  TrainConfig,
)
from moejax.convert import deepseek, families
from moejax.convert.hf_in import HF_FILES, TENSOR_DTYPES
from moejax.train.checkpoint import Checkpointer

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _run_config(run_dir: str) -> tuple[ModelConfig, MoEConfig, TrainConfig]:
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"{run_dir} has no config.json; give a run dir that trained or that "
                      "`python -m moejax.convert from_hf` wrote.")
  with open(path) as f:
    d = json.load(f)
  return ModelConfig(**d["model"]), MoEConfig(**d["moe"]), TrainConfig(**d["train"])


def _template(run_dir: str, train: TrainConfig) -> str | None:
  """The directory holding the converted model's own config.json, if any."""
  for base in (run_dir, train.init_from):
    if base and os.path.exists(os.path.join(base, "hf", "config.json")):
      return os.path.join(base, "hf")
  return None


def to_hf(run_dir: str, out_dir: str, family: str | None = None, dtype: str | None = None,
          max_shard_bytes: int = 5 * 2**30) -> dict:
  """Writes `out_dir`/{model*.safetensors, config.json, ...}; returns the config.json dict."""
  model, moe, train = _run_config(run_dir)
  hf_dir = _template(run_dir, train)
  template = None
  if hf_dir:
    with open(os.path.join(hf_dir, "config.json")) as f:
      template = json.load(f)
  kind = family or (template or {}).get("model_type")
  if kind is None:
    raise ConfigError(f"{run_dir} was not converted from a Hugging Face model; say which "
                      f"family to write with --family ({', '.join(sorted(families.FAMILIES))}).")
  fam = families.FAMILIES.get(kind)
  _check_family(fam, kind, model, moe)
  template_dtype = (template or {}).get("dtype") or (template or {}).get("torch_dtype")
  # each tensor in the dtype it came in where that is known (float8 excepted), unless --dtype
  kept = {} if dtype or not hf_dir else _came_in(hf_dir)
  dtype = dtype or template_dtype or "float32"
  if dtype not in DTYPES:
    raise ConfigError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}.")
  ckpt = Checkpointer(run_dir, CheckpointConfig())
  try:
    params, _ = ckpt.read_params(bias=True)
  finally:
    ckpt.close()
  os.makedirs(out_dir, exist_ok=True)
  names = families.tensor_names(fam, model.num_layers, moe.num_experts, model, moe,
                                deepseek.interleaved(template))
  dtypes = {name: DTYPES[kept.get(name, dtype)] for name in names}
  weight_map = _write_shards(params, names, dtypes, out_dir, max_shard_bytes)
  config = families.hf_config(fam, model, moe, dtype, template)
  if hf_dir:
    for name in HF_FILES[1:]:
      if os.path.exists(os.path.join(hf_dir, name)):
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out_dir, name))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  if len(set(weight_map.values())) > 1:
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
  return config


def _check_family(fam, kind: str, model: ModelConfig, moe: MoEConfig) -> None:
  """One line where the run's model has no place in the family's tensors."""
  if fam is not None and families.is_deepseek(fam):
    fits = (model.kv_lora_rank and moe.moe_every == 1 and moe.gate == "sigmoid" and
            model.qk_norm == "none")
    if not fits:
      raise ConfigError(f"--family {kind!r} holds multi-head latent attention (model."
                        "kv_lora_rank > 0), sigmoid routing and an MoE block in every layer "
                        "after moe.first_dense; this run's model differs.")
    return
  if (moe.moe_every != 1 or moe.first_dense or moe.num_shared_experts or moe.gate != "softmax"
      or model.kv_lora_rank or moe.n_group > 1 or model.mtp_depth):
    raise ConfigError("to_hf writes this model as DeepSeek-V3 (--family deepseek_v3) or not at "
                      "all: Mixtral, Qwen3-MoE and OLMoE have a softmax-routed MoE block in every "
                      "layer, no shared experts and multi-head attention; this run's differ.")
  if fam is None or fam.qk_norm != model.qk_norm:
    fits = [f.model_type for f in families.FAMILIES.values()
            if f.qk_norm == model.qk_norm and not families.is_deepseek(f)]
    raise ConfigError(f"--family {kind!r} cannot hold this model (model.qk_norm="
                      f"{model.qk_norm!r}); use one of {fits}.")


def _came_in(hf_dir: str) -> dict[str, str]:
  """{tensor: dtype} of the converted checkpoint's tensors that moejax writes (from_hf's
  record; DeepSeek keeps its router's bias in float32 beside bfloat16 weights)."""
  path = os.path.join(hf_dir, TENSOR_DTYPES)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {name: kind for name, kind in json.load(f).items() if kind in DTYPES}


def _write_shards(params: dict, names: dict, dtypes: dict, out_dir: str, max_bytes: int) -> dict:
  """Tensors in `names`' order into shards of at most `max_bytes` (one tensor may exceed it)."""
  from safetensors.numpy import save_file

  host: dict = {}

  def leaf(path):
    if path not in host:    # one host copy per leaf, dropped when its last tensor is cut
      node = params
      for key in path:
        node = node[key]
      host[path] = np.asarray(node)
    return host[path]

  last = {}
  for name, (path, _, _) in names.items():
    last[path] = name
  shards, current, size = [], {}, 0
  for name, (path, index, how) in names.items():
    x = np.ascontiguousarray(families.from_leaf(leaf(path)[index], how).astype(dtypes[name]))
    if current and size + x.nbytes > max_bytes:
      shards.append(current)
      _save_part(save_file, current, out_dir, len(shards))
      current, size = {}, 0
    current[name] = x
    size += x.nbytes
    if last[path] == name:
      host.pop(path)
  shards.append(current)
  _save_part(save_file, current, out_dir, len(shards))
  total = len(shards)
  weight_map = {}
  for i, shard in enumerate(shards, 1):
    final = "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
    os.replace(os.path.join(out_dir, f"part-{i:05d}.safetensors"), os.path.join(out_dir, final))
    weight_map.update({n: final for n in shard})
    shard.clear()
  return weight_map


def _save_part(save_file, tensors: dict, out_dir: str, number: int) -> None:
  """A full shard to disk under a provisional name (the total is known only at the end); its
  arrays are dropped once written."""
  save_file(tensors, os.path.join(out_dir, f"part-{number:05d}.safetensors"),
            metadata={"format": "pt"})
  for key in tensors:
    tensors[key] = None
