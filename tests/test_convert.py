"""Hugging Face checkpoints in and out (moejax.convert): for Mixtral, Qwen3-MoE and OLMoE, a
tiny random model built with transformers' own config class and saved in several shards is
converted in; moejax's logits equal transformers' on the 8-device mesh in ep and in fsep under
non-trivial layouts; converted back, every tensor equals the original bit for bit; training
from it lowers the loss."""

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

from moejax.config import ConfigError, OptimConfig, num_moe_layers  # noqa: E402
from moejax.convert import __main__ as cli, families, from_hf, to_hf  # noqa: E402
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
COMMON = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=E, intermediate_size=F,
                                       rope_theta=1e6)),
    # head_dim 32 != d_model / heads, as in Qwen3-30B-A3B; the k gates renormalised
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=E, moe_intermediate_size=F,
                                         intermediate_size=2 * F, head_dim=32,
                                         norm_topk_prob=True, rope_theta=1e6)),
    "olmoe": ("OlmoeConfig", dict(num_experts=E, intermediate_size=F, norm_topk_prob=False,
                                  eos_token_id=VOCAB - 1, pad_token_id=1)),
}
FAMILIES_BY_NAME = families.FAMILIES


@functools.cache
def _saved(family: str, root: str):
  cls_name, extra = FAMILIES[family]
  cfg = getattr(transformers, cls_name)(**COMMON, **extra)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():        # weights large enough that routing and QK-norm matter
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.1)
  path = os.path.join(root, family)
  model.save_pretrained(path, max_shard_size="60KB")
  return path, model


def saved_model(family, tmp_path_factory):
  return _saved(family, str(tmp_path_factory.getbasetemp()))


def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(np.array(tokens), dtype=torch.long)).logits.numpy()


def tokens(seed=0, length=SEQ):
  return jax.random.randint(jax.random.key(seed), (BATCH, length), 0, VOCAB)


def restored(cfg, run_dir, shape):
  """(model, layout, tx, state) with the converted weights, on a (data, expert, model) mesh."""
  mesh = mesh_of_shape(shape)
  model = Transformer(cfg.model, cfg.moe, mesh)
  layers = num_moe_layers(cfg.model, cfg.moe)
  layout = jax.device_put(initial_layout(cfg.moe, layers, shape[1]), replicated(mesh))
  tx = optimizer(OptimConfig(learning_rate=3e-3, warmup_steps=1), 10)
  shardings = state_shardings(model, tx, mesh, layout, BATCH, SEQ)
  state = init_state(model, tx, shardings, layout, BATCH, SEQ, 0)
  ckpt = Checkpointer(run_dir, cfg.checkpoint)
  try:
    got = ckpt.restore_weights(state, layout, cfg.moe.expert_mode)
  finally:
    ckpt.close()
  return model, got.layout, tx, state.replace(params=got.state.params)


def shuffled_layout(cfg, shape, seed=0):
  """ep: experts in a random slot order per layer; fsep: random replicas, shares and
  per-source local parts (tests.moe_helpers)."""
  rng = np.random.default_rng(seed)
  layers, n = num_moe_layers(cfg.model, cfg.moe), shape[1]
  if cfg.moe.expert_mode == "ep":
    places = [placement_lib.one_copy(rng.permutation(E).astype(np.int32), n)
              for _ in range(layers)]
    reps = 1
  else:
    slots = cfg.moe.slots_per_device
    places = [with_local(random_placement(rng, n, slots), rng) for _ in range(layers)]
    reps = n
  return jax.device_put(from_placements(places, E, reps), replicated(mesh_of_shape(shape)))


# ep: experts over 4 devices, 2 data rows, a random permutation of slots; fsep: F split over
# (expert 4 x model 2), 3 slots per device with random replicas and shares.
CASES = {"ep": ((2, 4, 1), dict(expert_mode="ep")),
         "fsep": ((1, 4, 2), dict(expert_mode="fsep", slots=3))}


def convert(family, mode, tmp_path_factory, tmp_path):
  hf_dir, model = saved_model(family, tmp_path_factory)
  shape, kw = CASES[mode]
  cfg = from_hf(hf_dir, str(tmp_path / "run"), mesh=shape, dtype="float32", **kw)
  # The reference routes every token: no capacity drops (8 slots' worth per slot).
  cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=8.0))
  return hf_dir, model, cfg, shape


@pytest.mark.slow   # 6 cases, each a forward compile on 8 devices
@pytest.mark.parametrize("mode", sorted(CASES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_reference(family, mode, tmp_path_factory, tmp_path):
  _, hf_model, cfg, shape = convert(family, mode, tmp_path_factory, tmp_path)
  model, layout, _, state = restored(cfg, str(tmp_path / "run"), shape)
  new = shuffled_layout(cfg, shape)
  params = state.params
  if mode == "ep":   # the weights follow the experts to their new slots
    params = migrate(state, layout, new).params
  x = tokens()

  def ce(p):
    head, stats = model.apply({"params": p}, x, new)
    logits = head.logits()
    return cross_entropy(logits[:, :-1], x[:, 1:]), (logits, stats)

  (_, (logits, stats)), grads = jax.jit(jax.value_and_grad(ce, has_aux=True))(params)
  assert int(jnp.sum(stats.dropped_W)) == 0
  m = cfg.model
  j = m.head_dim or m.d_model // m.num_heads
  # float32 reductions along the path: per layer q/k/v (D), scores (J), values (S), output
  # (H*J), router and experts (D, F, k); then the unembedding (D).
  n = m.num_layers * (3 * D + j + SEQ + m.num_heads * j + 2 * D + F + 2) + D
  assert_close(logits, hf_logits(hf_model, x), n, err_msg=f"{family} {mode}")
  # Gradients of the same cross-entropy, in expert-id order on transformers' side too; the
  # backward pass adds the sums over the batch's tokens.
  grads = to_canonical(grads, new) if mode == "ep" else convert_tree(grads, "fsep", "ep")
  pad = hf_model.config.pad_token_id   # transformers never trains the pad token's embedding
  if pad is not None:
    grads["embed"] = grads["embed"].at[pad].set(0.0)
  want = hf_grads(hf_model, x, FAMILIES_BY_NAME[family], jax.tree.map(np.shape, grads))
  assert_trees_close(grads, want, 2 * n + 2 * BATCH * SEQ)


def hf_grads(model, x, fam, shapes):
  """transformers' gradients of its mean next-token cross-entropy on `x`, as a moejax params
  tree (expert-id order). In memory transformers 5 fuses each layer's experts: gate_up_proj
  [E, 2F, D] (gate rows first) and down_proj [E, D, ffn]."""
  model.zero_grad()
  model(input_ids=torch.as_tensor(np.array(x), dtype=torch.long),
        labels=torch.as_tensor(np.array(x), dtype=torch.long)).loss.backward()
  out = jax.tree.map(lambda s: np.zeros(s, np.float32), shapes,
                     is_leaf=lambda s: isinstance(s, tuple))
  saved = families.tensor_names(fam, len(out["layers"]["ln_moe"]["scale"]), E)
  for name, p in model.named_parameters():
    g = p.grad.numpy()
    if ".mlp.experts." in name:
      layer = int(name.split(".")[2])
      moe = out["layers"]["moe"]
      if name.endswith("gate_up_proj"):
        moe["w_gate"][layer] = g[:, :F].transpose(0, 2, 1)
        moe["w_up"][layer] = g[:, F:].transpose(0, 2, 1)
      else:
        moe["w_down"][layer] = g.transpose(0, 2, 1)
      continue
    leaf, index, how = saved[name.replace(".mlp.gate.", f".{fam.moe}.gate.")]
    node = out
    for key in leaf[:-1]:
      node = node[key]
    node[leaf[-1]][index] = families.to_leaf(g, how, node[leaf[-1]][index].shape)
  return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_is_bit_exact(family, tmp_path_factory, tmp_path):
  hf_dir, hf_model = saved_model(family, tmp_path_factory)
  run, out = str(tmp_path / "run"), str(tmp_path / "out")   # through the command line
  assert cli.main(["from_hf", hf_dir, run, "--mesh", "1,4,1", "--expert_mode", "fsep"]) == 0
  assert cli.main(["to_hf", run, out, "--max_shard_gib", str(40_000 / 2**30)]) == 0
  assert len([n for n in os.listdir(hf_dir) if n.endswith(".safetensors")]) > 1
  assert len([n for n in os.listdir(out) if n.endswith(".safetensors")]) > 1
  want, got = safetensors_tensors(hf_dir), safetensors_tensors(out)
  assert sorted(got) == sorted(want)
  for name, x in want.items():
    assert got[name].dtype == x.dtype and got[name].tobytes() == x.tobytes(), name
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  x = tokens(1)
  np.testing.assert_array_equal(hf_logits(back, x), hf_logits(hf_model, x))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["model_type"] == family


@pytest.mark.slow   # three families' train steps compiled
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_from_converted_lowers_loss(family, tmp_path_factory, tmp_path):
  _, _, cfg, shape = convert(family, "ep", tmp_path_factory, tmp_path)
  model, layout, tx, state = restored(cfg, str(tmp_path / "run"), shape)
  mesh = mesh_of_shape(shape)
  step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, moe_cfg=cfg.moe,
                                   lr_schedule=schedule(cfg.optim, 10)))
  batch = jax.device_put(tokens(2, SEQ + 1),
                         jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                             ("data", "expert"))))
  losses = []
  for _ in range(6):
    state, metrics = step(state, batch, layout)
    losses.append(float(metrics["ce"]))
  assert not bool(metrics["skipped"])
  assert losses[5] < losses[0] - 0.05, losses   # losses[0]: the converted weights' loss


def test_unsupported_config_is_one_line(tmp_path):
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(ConfigError,
                     match="model_type='llama'; moejax converts deepseek_v3, kimi_k2, mixtral"):
    from_hf(str(hf), str(tmp_path / "run"))
  (hf / "config.json").write_text(json.dumps({"model_type": "mixtral", "sliding_window": 4096,
                                              "hidden_act": "silu"}))
  with pytest.raises(ConfigError, match="sliding_window=4096"):
    from_hf(str(hf), str(tmp_path / "run"))


def _char_tokenizer(hf_dir):
  """A character-level tokenizer.json beside the model: <unk>, <s>, </s> as ids 0-2 (Mixtral's
  bos 1 and eos 2), then printable ASCII; 98 ids for the model's 128 embedding rows."""
  from tokenizers import Tokenizer, models

  vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [chr(c) for c in range(32, 127)])}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
  tok.add_special_tokens(["<unk>", "<s>", "</s>"])
  path = os.path.join(hf_dir, "tokenizer.json")
  tok.save(path)
  return path


def _prepared(tmp_path, tokenizer):
  from moejax.prepare_data import prepare

  rng = np.random.default_rng(0)
  words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
  for i in range(12):
    text = "\n".join(" ".join(rng.choice(words, 8)) for _ in range(40))
    (tmp_path / "text").mkdir(exist_ok=True)
    (tmp_path / "text" / f"f{i}.txt").write_text(text)
  out = str(tmp_path / "data")
  meta = prepare(str(tmp_path / "text" / "*.txt"), out, tokenizer=tokenizer, val_fraction=0.25,
                 progress=False)
  return out, meta


def test_data_takes_the_models_vocab_and_special_tokens(tmp_path):
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "bos_token_id": 1,
                                              "eos_token_id": 2}))
  _, meta = _prepared(tmp_path, _char_tokenizer(str(hf)))
  assert (meta["vocab_size"], meta["tokenizer_vocab_size"], meta["separator"]) == (VOCAB, 98,
                                                                                    [2, 1])


@pytest.mark.slow   # a converted run trained end to end by the trainer (one compile)
def test_train_py_starts_from_a_converted_model(tmp_path_factory, tmp_path):
  from moejax.frontend import parse_config
  from moejax.train.trainer import Trainer

  hf_dir, _ = saved_model("mixtral", tmp_path_factory)
  tokenizer = _char_tokenizer(hf_dir)
  data_dir, _ = _prepared(tmp_path, tokenizer)
  run = str(tmp_path / "run")
  from_hf(hf_dir, run, mesh=(2, 4, 1), dtype="float32")
  bindings = [f"data.path = '{data_dir}'", "data.seq_len = 16", "data.global_batch_size = 8",
              "train.num_steps = 3", "train.eval_every = 3", "train.eval_batches = 1",
              "train.progress_bar = False", "train.tensorboard = False"]
  cfg = parse_config([os.path.join(run, "model.gin")], bindings)
  assert cfg.train.init_from == os.path.abspath(run)
  with Trainer(cfg) as trainer:
    summary = trainer.run()
    # A trained run dir (a whole train state) serves as train.init_from too: its weights.
    trained_dir = Checkpointer(os.path.join(run, "train"), cfg.checkpoint)
    try:
      again = trained_dir.restore_weights(trainer.state, trainer.pool.layout, "ep")
    finally:
      trained_dir.close()
    jax.tree.map(np.testing.assert_array_equal, again.state.params, trainer.state.params)
  assert summary["start_step"] == 0 and summary["saved_step"] == 3
  # The run's first step computed on the converted weights: they come back from its own
  # checkpoint after 3 steps only moved by the optimizer (AdamW steps of at most lr each).
  ckpt = Checkpointer(os.path.join(run, "train"), cfg.checkpoint)
  try:
    trained, _ = ckpt.read_params()
  finally:
    ckpt.close()
  source = Checkpointer(run, cfg.checkpoint)
  try:
    converted, _ = source.read_params()
  finally:
    source.close()
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), trained, converted)
  assert 0 < max(jax.tree.leaves(moved)) < 4 * cfg.optim.learning_rate
  # Data prepared with another vocabulary stops the run with one line.
  bytes_dir = str(tmp_path / "bytes_data")
  from moejax.prepare_data import prepare

  prepare(str(tmp_path / "text" / "*.txt"), bytes_dir, byte_level=True, val_fraction=0.25,
          progress=False)
  with pytest.raises(ConfigError, match="prepared with vocab_size=256.*tokenizer of "
                                        "train.init_from"):
    Trainer(parse_config([os.path.join(run, "model.gin")], bindings[1:] + [
        f"data.path = '{bytes_dir}'"]))


@pytest.mark.slow   # three families converted out without their own config.json
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_model_without_its_config_leaves_as_the_family(family, tmp_path_factory, tmp_path):
  """A run with no Hugging Face config to start from (trained from scratch) leaves with the
  family's keys written from moejax's config: transformers then computes the same logits."""
  hf_dir, hf_model = saved_model(family, tmp_path_factory)
  run, out = str(tmp_path / "run"), str(tmp_path / "out")
  from_hf(hf_dir, run, mesh=(1, 4, 1), dtype="float32")
  os.remove(os.path.join(run, "hf", "config.json"))
  with pytest.raises(ConfigError, match="--family"):
    to_hf(run, out)
  to_hf(run, out, family=family)
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  x = tokens(3)
  np.testing.assert_array_equal(hf_logits(back, x), hf_logits(hf_model, x))
