"""DeepSeek-V3-architecture checkpoints in and out (moejax.convert.deepseek), against
transformers' own DeepseekV3 classes with tiny random configs built here (no downloads):

- "v3": low-rank query, YaRN, DeepSeek's paired rotary layout, 2 of 4 expert groups, a dense
  first layer, a shared expert, a non-zero routing bias and a multi-token prediction layer
  (added as its own shard, as the published checkpoints hold it);
- "lite": a full-rank query (V2-Lite, Moonlight), plain RoPE in halves, no groups, bfloat16.

The logits and the gradients of the cross-entropy equal transformers' in ep (2 x 4 x 1,
shuffled slots) and fsep (1 x 4 x 2, random replicas and shares); converted back out, every
tensor is the original bit for bit (several shards, float32 beside bfloat16); float8
block-quantised weights come in dequantised (their scales in another shard) and leave in
the config's dtype; training from the converted model lowers the loss, its MTP term too."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra is not installed (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from moejax.config import CheckpointConfig, OptimConfig, num_moe_layers  # noqa: E402
from moejax.convert import __main__ as cli, deepseek, from_hf, to_hf  # noqa: E402
from moejax.layout import host_layout as placement_lib  # noqa: E402
from moejax.layout.canonical import convert_tree, to_canonical  # noqa: E402
from moejax.layout.migrate import migrate  # noqa: E402
from moejax.layout.tables import from_placements  # noqa: E402
from moejax.model.mesh import mesh_of_shape, replicated  # noqa: E402
from moejax.model.transformer import Transformer  # noqa: E402
from moejax.train import step as step_lib  # noqa: E402
from moejax.train.checkpoint import Checkpointer  # noqa: E402
from moejax.train.loss import cross_entropy  # noqa: E402
from moejax.train.optim import optimizer, schedule  # noqa: E402
from moejax.train.programs import initial_layout  # noqa: E402
from moejax.train.state import init_state, state_shardings  # noqa: E402
from tests.helpers import safetensors_tensors  # noqa: E402
from tests.moe_helpers import random_placement, with_local  # noqa: E402
from tests.numerics import assert_close, assert_trees_close  # noqa: E402

BATCH, SEQ, VOCAB, D, F, E = 8, 16, 128, 64, 32, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=96, moe_intermediate_size=F,
              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
              num_key_value_heads=4, n_routed_experts=E, num_experts_per_tok=2,
              n_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, routed_scaling_factor=2.5, max_position_embeddings=64)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1}
VARIANTS = {
    "v3": dict(q_lora_rank=24, n_group=4, topk_group=2, rope_parameters=YARN,
               rope_interleave=True),
    "lite": dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
}


def _mtp_shard(path, model, cfg):
  """DeepSeek's multi-token layer (layer num_hidden_layers) as one more shard and in the
  index: layer 1's tensors' shapes, random values; embedding and head the main model's."""
  from safetensors.torch import save_file

  rng = torch.Generator().manual_seed(1)
  layers = cfg.num_hidden_layers
  state = model.state_dict()
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    index = json.load(f)
  tensors = {}
  for name in index["weight_map"]:
    if name.startswith("model.layers.1."):
      like = state.get(name)
      if like is None:              # an expert's tensor: the fused in-memory weight's slice
        like = torch.empty(F, D) if "down_proj" not in name else torch.empty(D, F)
      rest = name.removeprefix("model.layers.1.")
      norm = "norm" in rest
      x = torch.randn(like.shape, generator=rng) * (0.2 if norm else 0.1) + float(norm)
      tensors[f"model.layers.{layers}.{rest}"] = x.to(like.dtype)
  p = f"model.layers.{layers}."
  dtype = state["model.norm.weight"].dtype
  for norm in ("enorm", "hnorm", "shared_head.norm"):
    tensors[f"{p}{norm}.weight"] = (1 + 0.2 * torch.randn(D, generator=rng)).to(dtype)
  tensors[p + "eh_proj.weight"] = (0.1 * torch.randn(D, 2 * D, generator=rng)).to(dtype)
  tensors[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
  tensors[p + "shared_head.head.weight"] = state["lm_head.weight"].clone()
  save_file(tensors, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
  index["weight_map"].update({n: "model-mtp.safetensors" for n in tensors})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f)


@functools.cache
def _saved(variant: str, root: str):
  cfg = transformers.DeepseekV3Config(**COMMON, **VARIANTS[variant])
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():        # weights large enough that routing, norms and the bias matter
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.1)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.normal_(0.0, 0.05)
  if variant == "lite":      # as published: bfloat16 weights, the routing bias in float32
    model = model.to(torch.bfloat16)
    for module in model.modules():
      if hasattr(module, "e_score_correction_bias"):
        module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
  path = os.path.join(root, variant)
  model.save_pretrained(path, max_shard_size="60KB")
  if variant == "v3":
    _mtp_shard(path, model, cfg)
  # the reference reads the files back in float32 (its rotary frequencies computed afresh,
  # not rounded to bfloat16 with the weights)
  return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def saved_model(variant, tmp_path_factory):
  return _saved(variant, str(tmp_path_factory.getbasetemp()))


def hf_logits(model, x):
  with torch.no_grad():
    return model(torch.as_tensor(np.array(x), dtype=torch.long)).logits.float().numpy()


def tokens(seed=0, length=SEQ):
  return jax.random.randint(jax.random.key(seed), (BATCH, length), 0, VOCAB)


CASES = {"ep": ((2, 4, 1), dict(expert_mode="ep")),
         "fsep": ((1, 4, 2), dict(expert_mode="fsep", slots=3))}


def converted(variant, mode, tmp_path_factory, tmp_path):
  """(hf model, the converted Config, model, layout, params, router bias) on the mode's mesh,
  the layout shuffled (ep: the weights migrated to it) and nothing dropped."""
  hf_dir, hf_model = saved_model(variant, tmp_path_factory)
  shape, kw = CASES[mode]
  run = str(tmp_path / "run")
  cfg = from_hf(hf_dir, run, mesh=shape, dtype="float32", **kw)
  cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=8.0))
  mesh = mesh_of_shape(shape)
  model = Transformer(cfg.model, cfg.moe, mesh)
  layers = num_moe_layers(cfg.model, cfg.moe)
  layout = jax.device_put(initial_layout(cfg.moe, layers, shape[1]), replicated(mesh))
  tx = optimizer(OptimConfig(learning_rate=3e-3, warmup_steps=1), 10)
  state = init_state(model, tx, state_shardings(model, tx, mesh, layout, BATCH, SEQ), layout,
                     BATCH, SEQ, 0)
  ckpt = Checkpointer(run, cfg.checkpoint)
  try:
    got = ckpt.restore_weights(state, layout, cfg.moe.expert_mode)
  finally:
    ckpt.close()
  state = state.replace(params=got.state.params, router_bias_LxE=got.state.router_bias_LxE)
  rng = np.random.default_rng(0)
  if mode == "ep":
    places = [placement_lib.one_copy(rng.permutation(E).astype(np.int32), shape[1])
              for _ in range(layers)]
    new = jax.device_put(from_placements(places, E, 1), replicated(mesh))
    state = migrate(state, got.layout, new)
  else:
    places = [with_local(random_placement(rng, shape[1], 3), rng) for _ in range(layers)]
    new = jax.device_put(from_placements(places, E, shape[1]), replicated(mesh))
  return hf_model, cfg, model, new, tx, state


@pytest.mark.slow   # 4 cases, each a forward and backward compile on 8 devices
@pytest.mark.parametrize("mode", sorted(CASES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_gradients_equal_transformers(variant, mode, tmp_path_factory, tmp_path):
  hf_model, cfg, model, layout, _, state = converted(variant, mode, tmp_path_factory, tmp_path)
  assert np.abs(np.asarray(state.router_bias_LxE)).max() > 0    # the published bias came in
  biased = step_lib.biased_layout(layout, state.router_bias_LxE)
  x = tokens()

  def ce(p):
    out, stats = model.apply({"params": p}, x, biased)
    logits = (out[0] if cfg.model.mtp_depth else out).logits()
    return cross_entropy(logits[:, :-1], x[:, 1:]), (logits, stats)

  (_, (logits, stats)), grads = jax.jit(jax.value_and_grad(ce, has_aux=True))(state.params)
  assert int(jnp.sum(stats.dropped_W)) == 0
  m = cfg.model
  # float32 reductions per layer: the latents (D), their expansions (ranks), scores (J),
  # values (Q), output (H * V), router and experts (D, F, k); then the unembedding (D).
  per_layer = (3 * D + m.q_lora_rank + m.kv_lora_rank + m.qk_nope_head_dim +
               m.qk_rope_head_dim + SEQ + m.num_heads * m.v_head_dim + F + 2)
  n = m.num_layers * per_layer + D
  want = hf_logits(hf_model, x)
  assert_close(logits, want, n, err_msg=f"{variant} {mode}")
  print(f"{variant} {mode}: max |logits - transformers'| = "
        f"{float(np.abs(np.asarray(logits) - want).max()):.3g} at max |logit| "
        f"{float(np.abs(want).max()):.3g}")
  grads = to_canonical(grads, layout) if mode == "ep" else convert_tree(grads, "fsep", "ep")
  grads.pop("mtp", None)      # the multi-token head is not in this loss
  want_grads = hf_grads(hf_model, x, cfg, jax.tree.map(np.shape, grads))
  assert_trees_close(grads, want_grads, 2 * n + 2 * BATCH * SEQ)
  worst = max(jax.tree.leaves(jax.tree.map(
      lambda g, w: float(np.abs(np.asarray(g) - w).max() / max(np.abs(w).max(), 1e-30)),
      grads, want_grads)))
  print(f"{variant} {mode}: max |grad - transformers'| / max |grad| over leaves = {worst:.3g}")


def hf_grads(model, x, cfg, shapes):
  """transformers' gradients of its mean next-token cross-entropy on `x` as a moejax params
  tree (expert-id order; the rotary rows permuted as the converter permutes them). In memory
  transformers 5 fuses each layer's experts: gate_up_proj [E, 2F, D], down_proj [E, D, F]."""
  model.zero_grad()
  model(input_ids=torch.as_tensor(np.array(x), dtype=torch.long),
        labels=torch.as_tensor(np.array(x), dtype=torch.long)).loss.backward()
  out = jax.tree.map(lambda s: np.zeros(s, np.float32), shapes,
                     is_leaf=lambda s: isinstance(s, tuple))
  names = deepseek.tensor_names(cfg.model, cfg.moe, model.config.rope_interleave)
  first = cfg.moe.first_dense
  for name, p in model.named_parameters():
    g = p.grad.float().numpy()
    if ".mlp.experts." in name:
      moe, layer = out["layers"]["moe"], int(name.split(".")[2]) - first
      if name.endswith("gate_up_proj"):
        moe["w_gate"][layer] = g[:, :F].transpose(0, 2, 1)
        moe["w_up"][layer] = g[:, F:].transpose(0, 2, 1)
      else:
        moe["w_down"][layer] = g.transpose(0, 2, 1)
      continue
    leaf, index, how = names[name]
    node = out
    for key in leaf[:-1]:
      node = node[key]
    node[leaf[-1]][index] = deepseek.to_leaf(g, how, node[leaf[-1]][index].shape) if \
        isinstance(how, tuple) else _plain(g, how, node[leaf[-1]][index].shape)
  return out


def _plain(g, how, shape):
  from moejax.convert import families

  return families.to_leaf(g, how, shape)


def _tensors(directory):
  return safetensors_tensors(directory, framework="pt")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_round_trip_is_bit_exact(variant, tmp_path_factory, tmp_path):
  hf_dir, hf_model = saved_model(variant, tmp_path_factory)
  run, out = str(tmp_path / "run"), str(tmp_path / "out")   # through the command line
  assert cli.main(["from_hf", hf_dir, run, "--mesh", "1,4,1", "--expert_mode", "fsep"]) == 0
  assert cli.main(["to_hf", run, out, "--max_shard_gib", str(40_000 / 2**30)]) == 0
  assert len([n for n in os.listdir(hf_dir) if n.endswith(".safetensors")]) > 1
  assert len([n for n in os.listdir(out) if n.endswith(".safetensors")]) > 1
  want, got = _tensors(hf_dir), _tensors(out)
  assert sorted(got) == sorted(want)
  if variant == "v3":
    assert "model.layers.3.eh_proj.weight" in got      # the multi-token layer went out too
  if variant == "lite":      # bfloat16 weights beside transformers' float32 routing bias
    kinds = {t.dtype for t in want.values()}
    assert kinds == {torch.bfloat16, torch.float32}, kinds
  for name, x in want.items():
    assert got[name].dtype == x.dtype and torch.equal(got[name].view(torch.uint8),
                                                      x.view(torch.uint8)), name
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  x = tokens(1)
  np.testing.assert_array_equal(hf_logits(back, x), hf_logits(
      transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval(), x))


def _quantised(hf_dir, out_dir, block=8):
  """`hf_dir`'s checkpoint with every 2-D projection block-quantised to float8 as DeepSeek
  publishes it (`weight_scale_inv` per block, the scales in a shard of their own), and the
  float32 checkpoint of the dequantised weights beside it."""
  from safetensors.torch import save_file

  tensors = _tensors(hf_dir)
  fp8, scales, plain = {}, {}, {}
  for name, x in tensors.items():
    x = x.float()
    if name.endswith("proj.weight") and x.ndim == 2:
      rows, cols = -(-x.shape[0] // block), -(-x.shape[1] // block)
      padded = torch.zeros(rows * block, cols * block)
      padded[:x.shape[0], :x.shape[1]] = x
      amax = padded.abs().reshape(rows, block, cols, block).amax((1, 3))
      scale = (amax / 448).clamp(min=1e-12)
      big = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
      q = (x / big[:x.shape[0], :x.shape[1]]).to(torch.float8_e4m3fn)
      fp8[name], scales[name + "_scale_inv"] = q, scale
      x = q.float() * big[:x.shape[0], :x.shape[1]]
    else:
      fp8[name] = tensors[name]
    plain[name] = x
  paths = {}
  for kind, parts in (("fp8", {"model-1.safetensors": fp8, "model-2.safetensors": scales}),
                      ("f32", {"model.safetensors": plain})):
    path = paths[kind] = os.path.join(out_dir, kind)
    os.makedirs(path)
    for file, part in parts.items():
      save_file(part, os.path.join(path, file), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
      config = json.load(f)
    if kind == "fp8":
      config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                       "weight_block_size": [block, block],
                                       "activation_scheme": "dynamic"}
      weight_map = {n: file for file, part in parts.items() for n in part}
      with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(config, f)
  return paths["fp8"], paths["f32"]


def test_float8_blocks_come_in_dequantised(tmp_path_factory, tmp_path):
  hf_dir, _ = saved_model("v3", tmp_path_factory)
  fp8_dir, f32_dir = _quantised(hf_dir, str(tmp_path))
  for name, src in (("fp8", fp8_dir), ("f32", f32_dir)):
    from_hf(src, str(tmp_path / name), mesh=(1, 4, 1), dtype="float32")
  read = {}
  for name in ("fp8", "f32"):
    ckpt = Checkpointer(str(tmp_path / name), CheckpointConfig())
    try:
      read[name] = ckpt.read_params(bias=True)[0]
    finally:
      ckpt.close()
  jax.tree.map(np.testing.assert_array_equal, read["fp8"], read["f32"])
  # The way out: the config's dtype (float32 here), no quantization; float8 never written.
  out = str(tmp_path / "out")
  to_hf(str(tmp_path / "fp8"), out)
  with open(os.path.join(out, "config.json")) as f:
    assert "quantization_config" not in json.load(f)
  written = _tensors(out)
  assert {t.dtype for t in written.values()} == {torch.float32}
  assert not any(n.endswith("_scale_inv") for n in written)


@pytest.mark.slow   # a train step compiled on 8 devices
def test_training_from_converted_lowers_the_loss(tmp_path_factory, tmp_path):
  _, cfg, model, layout, tx, state = converted("v3", "ep", tmp_path_factory, tmp_path)
  assert cfg.model.mtp_depth == 1
  mesh = mesh_of_shape(CASES["ep"][0])
  step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, moe_cfg=cfg.moe,
                                   lr_schedule=schedule(cfg.optim, 10)))
  batch = jax.device_put(tokens(2, SEQ + 1), jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(("data", "expert"))))
  ce, mtp = [], []
  for _ in range(6):
    state, metrics = step(state, batch, layout)
    ce.append(float(metrics["ce"]))
    mtp.append(float(metrics["mtp_ce"]))
  assert not bool(metrics["skipped"])
  assert ce[5] < ce[0] - 0.05, ce      # ce[0]: the converted weights' loss
  assert mtp[5] < mtp[0] - 0.05, mtp


@pytest.mark.slow   # a conversion in and out and two transformers forwards
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_model_without_its_config_leaves_as_deepseek_v3(variant, tmp_path_factory, tmp_path):
  """A run with no Hugging Face config to start from (trained from scratch) leaves with the
  DeepSeek-V3 keys written from moejax's config (the rotary parts in DeepSeek's pairs, YaRN,
  groups, the multi-token layer): transformers then computes the same logits."""
  hf_dir, hf_model = saved_model(variant, tmp_path_factory)
  run, out = str(tmp_path / "run"), str(tmp_path / "out")
  from_hf(hf_dir, run, mesh=(1, 4, 1), dtype="float32")
  os.remove(os.path.join(run, "hf", "config.json"))
  to_hf(run, out, family="deepseek_v3")
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  assert config["rope_interleave"] and config["num_nextn_predict_layers"] == (variant == "v3")
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  x = tokens(3)
  want = hf_logits(hf_model, x)
  assert_close(hf_logits(back, x), want, 2 * D, err_msg=variant)
