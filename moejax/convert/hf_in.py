"""`from_hf`: a Hugging Face checkpoint -> a step-0 moejax checkpoint and the gin config for it.

Tensors are read one at a time from the memory-mapped safetensors shards, in shard order, into
one float32 buffer per moejax parameter (expert-id order); each buffer becomes a device array
as soon as it is complete, so the host holds the model once in float32 plus one buffer in
flight. The checkpoint is written by the trainer's own `Checkpointer`: weights only (no
optimizer state), which `train.init_from` starts a new run from.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.config import (
  Config,
  ConfigError,
  DataConfig,
  MeshConfig,
  ModelConfig,
  MoEConfig,
  OptimConfig,
  TrainConfig,
  num_moe_layers,
)
from moejax.convert import deepseek, families
from moejax.layout.canonical import convert_tree
from moejax.model.mesh import mesh_of_shape
from moejax.model.transformer import Transformer
from moejax.train.checkpoint import Checkpointer, model_fields
from moejax.train.programs import initial_layout
from moejax.train.state import TrainState

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json")   # kept in RUN_DIR/hf for `to_hf` and the data step
GIN_FILE = "model.gin"
TENSOR_DTYPES = "tensor_dtypes.json"   # in RUN_DIR/hf: each tensor's dtype, for `to_hf`


def shard_files(hf_dir: str) -> list[str]:
  """The safetensors files of a checkpoint directory, in the index's order."""
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    raise ConfigError(f"{hf_dir} holds no model.safetensors(.index.json); give the directory "
                      "that save_pretrained wrote (pytorch .bin checkpoints are not read).")
  return [os.path.join(hf_dir, f) for f in files]


def stored_names(hf_dir: str) -> set[str]:
  """The tensor names a checkpoint holds (from its index, or the one file's header)."""
  from safetensors import safe_open

  index = os.path.join(hf_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      return set(json.load(f)["weight_map"])
  names: set[str] = set()
  for file in shard_files(hf_dir):
    with safe_open(file, framework="np") as f:
      names.update(f.keys())
  return names


def has_mtp(hf: dict, names: set[str]) -> bool:
  """Whether the checkpoint holds DeepSeek-V3's multi-token prediction layer (layer
  num_hidden_layers; published configs count it even where the weights are left out)."""
  return f"model.layers.{hf.get('num_hidden_layers')}.eh_proj.weight" in names


def build_config(hf: dict, mesh: tuple[int, int, int], expert_mode: str, dtype: str,
                 run_dir: str, slots: int = 0, mtp: bool = False) -> Config:
  """The moejax Config of a config.json, for the mesh (data, expert, model) and expert mode;
  `mtp`: the checkpoint holds a multi-token prediction layer."""
  model, moe = families.moe_config(hf, mtp)
  cfg = Config(
      mesh=MeshConfig(data=mesh[0], expert=mesh[1], model=mesh[2],
                      host_device_count=max(math.prod(mesh), 1)),
      model=ModelConfig(dtype=dtype, **model),
      moe=MoEConfig(expert_mode=expert_mode, slots_per_device=slots, **moe),
      data=DataConfig(seq_len=min(DataConfig.seq_len, model["max_seq_len"])),
      # continued training of a trained model: a fine-tuning rate, not a from-scratch one
      optim=OptimConfig(learning_rate=2e-5, warmup_steps=100),
      train=TrainConfig(run_dir=os.path.join(run_dir, "train"), init_from=run_dir))
  return cfg.validate()


def _param_shapes(cfg: Config) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{param path: shape} of the canonical (ep, one slot per expert) params, traced on one
  device: nothing is allocated."""
  moe = dataclasses.replace(cfg.moe, expert_mode="ep")
  model = Transformer(cfg.model, moe, mesh_of_shape((1, 1, 1)))
  layout = initial_layout(moe, num_moe_layers(cfg.model, moe), 1)
  tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  boxed = jax.eval_shape(lambda t: model.init(jax.random.key(0), t, layout), tokens)
  flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(boxed)["params"])[0]
  return {tuple(k.key for k in path): tuple(x.shape) for path, x in flat}


def read_params(hf_dir: str, fam: families.Family, cfg: Config,
                hf: dict | None = None) -> tuple[dict, dict]:
  """({path: device array} of the canonical params, read tensor by tensor (see module doc);
  {tensor: its dtype}). DeepSeek-V3's routing bias comes as the leaf `router_bias_LxE`, its
  float8 block-quantised weights dequantised with their `weight_scale_inv` (`hf`: the
  config.json)."""
  hf = hf or {}
  shapes = _param_shapes(cfg)
  shapes[(deepseek.BIAS,)] = (num_moe_layers(cfg.model, cfg.moe), cfg.moe.num_experts)
  names = families.tensor_names(fam, cfg.model.num_layers, cfg.moe.num_experts, cfg.model,
                                cfg.moe, deepseek.interleaved(hf))
  block = tuple((hf.get("quantization_config") or {}).get("weight_block_size", (128, 128)))
  pending = {leaf: 0 for leaf in shapes}     # HF tensors still to come per leaf
  for leaf, _, how in names.values():
    if leaf not in shapes:
      raise ConfigError(f"moejax has no parameter {'/'.join(leaf)}; this is a bug in "
                        "moejax.convert.families.")
    pending[leaf] += not str(how).startswith("dup:")
  pending = {leaf: n for leaf, n in pending.items() if n}
  buffers: dict = {}
  out: dict = {}
  seen = set()
  quantised: dict = {}      # float8 weights or scales whose partner is still to come
  dtypes = {}

  def place(name, x):
    leaf, index, how = names[name]
    buf = buffers.setdefault(leaf, None)
    if buf is None:
      buf = buffers[leaf] = np.empty(shapes[leaf], np.float32)
    target = buf[index]
    if x.size != target.size:
      raise ConfigError(f"{name} has shape {list(x.shape)} but config.json makes it "
                        f"{target.size} values; the config and the weights disagree.")
    target[...] = families.to_leaf(x, how, target.shape)
    seen.add(name)
    pending[leaf] -= 1
    if pending[leaf] == 0:    # complete: to the device, and the host copy goes
      out[leaf] = jnp.asarray(buffers.pop(leaf))

  for file in shard_files(hf_dir):
    for name, x in _tensors(file):
      dtypes[name] = x.dtype.name
      weight = name.removesuffix("_scale_inv")
      if name not in names and not (weight != name and weight in names):
        raise ConfigError(f"{file} holds {name}, which moejax's {fam.model_type} has no "
                          "place for; convert a checkpoint of the plain architecture.")
      if str(names[weight][2]).startswith("dup:"):   # the main model's copy (DeepSeek's MTP)
        seen.add(weight)
        continue
      if weight != name or x.dtype.itemsize == 1:    # a float8 weight and its scale, paired
        other = quantised.pop(weight, None)
        if other is None:
          quantised[weight] = (name, x)
          continue
        w, scale = (x, other[1]) if weight == name else (other[1], x)
        x = deepseek.dequantize(w, scale, block)
      place(weight, x)
  if quantised:
    name, _ = next(iter(quantised.values()))
    raise ConfigError(f"{hf_dir}: {name} has no partner (a float8 weight needs its "
                      "weight_scale_inv); is the checkpoint complete?")
  missing = sorted(set(names) - seen)
  if missing:
    raise ConfigError(f"{hf_dir} lacks {len(missing)} tensors the config needs, e.g. "
                      f"{missing[0]}; is the checkpoint complete?")
  tree: dict = {}
  for leaf, x in out.items():
    node = tree
    for key in leaf[:-1]:
      node = node.setdefault(key, {})
    node[leaf[-1]] = x
  return tree, dtypes


# safetensors' numpy reader has no float8; these are read from the file's bytes
_RAW = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _tensors(file: str):
  """(name, numpy array) of a safetensors file in its order, memory-mapped."""
  from safetensors import safe_open

  with open(file, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
  with safe_open(file, framework="np") as f:
    for name in f.keys():
      meta = header[name]
      if meta["dtype"] in _RAW:
        start, end = meta["data_offsets"]
        raw = np.memmap(file, np.uint8, "r", offset=8 + size + start, shape=(end - start,))
        yield name, raw.view(_RAW[meta["dtype"]]).reshape(meta["shape"])
      else:
        yield name, f.get_tensor(name)


def gin_text(cfg: Config, hf_dir: str, family: str) -> str:
  defaults = Config()
  lines = [f"# {family} from {os.path.abspath(hf_dir)}, by python -m moejax.convert from_hf.",
           "# Train: python train.py --gin_file=THIS --gin_bindings=\"data.path = 'DATA'\", DATA "
           "prepared with",
           "# python -m moejax.prepare_data --tokenizer RUN_DIR/hf/tokenizer.json (the model's",
           "# vocab and special tokens). Dense dispatch drops tokens past moe.capacity_factor,",
           "# which the reference never does (moe.dispatch = 'ragged' on GPU does not).",
           ""]
  for part in ("mesh", "model", "moe", "data", "optim", "train"):
    now, default = getattr(cfg, part), getattr(defaults, part)
    for field in dataclasses.fields(now):   # the model whole, of the rest what differs
      value = getattr(now, field.name)
      if part in ("mesh", "model", "moe") or value != getattr(default, field.name):
        lines.append(f"{part}.{field.name} = {value!r}")
  return "\n".join(lines) + "\n"


def from_hf(hf_dir: str, run_dir: str, mesh=(1, 8, 1), expert_mode: str = "ep",
            dtype: str = "bfloat16", slots: int = 0) -> Config:
  """Writes `run_dir`/{checkpoints/0, model.gin, config.json, hf/}; returns the Config."""
  with open(os.path.join(hf_dir, "config.json")) as f:
    hf = json.load(f)
  fam = families.family_of(hf)
  if mesh[1] < 1:
    raise ConfigError(f"--mesh {mesh}: give the expert axis's size (the layout depends on it).")
  cfg = build_config(hf, mesh, expert_mode, dtype, os.path.abspath(run_dir), slots,
                     families.is_deepseek(fam) and has_mtp(hf, stored_names(hf_dir)))
  ckpt = Checkpointer(run_dir, cfg.checkpoint)
  if ckpt.latest_step() is not None:
    ckpt.close()
    raise ConfigError(f"{run_dir} already holds a checkpoint; give a new directory.")
  params, dtypes = read_params(hf_dir, fam, cfg, hf)
  layers = num_moe_layers(cfg.model, cfg.moe)
  layout = jax.device_put(initial_layout(cfg.moe, layers, mesh[1]), jax.devices()[0])
  bias = params.pop(deepseek.BIAS, None)     # DeepSeek-V3's routing bias: train state
  if bias is None:
    bias = jnp.zeros((layers, cfg.moe.num_experts), jnp.float32)
  state = TrainState(step=jnp.zeros((), jnp.int32),
                     params=convert_tree(params, "ep", expert_mode), opt_state=None,
                     router_bias_LxE=bias)
  meta = {"data_position": 0, "model": model_fields(cfg), "converted_from": hf_dir}
  try:
    ckpt.save(0, state, layout, meta, expert_mode, canonical=True)
    ckpt.wait()
  finally:
    ckpt.close()
  os.makedirs(os.path.join(run_dir, "hf"), exist_ok=True)
  for name in HF_FILES:
    if os.path.exists(os.path.join(hf_dir, name)):
      shutil.copyfile(os.path.join(hf_dir, name), os.path.join(run_dir, "hf", name))
  with open(os.path.join(run_dir, "hf", TENSOR_DTYPES), "w") as f:
    json.dump(dtypes, f, indent=0)
  with open(os.path.join(run_dir, GIN_FILE), "w") as f:
    f.write(gin_text(cfg, hf_dir, fam.model_type))
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=2)
  return cfg
