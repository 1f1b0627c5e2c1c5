"""`python -m moejax.generate RUN_DIR --prompt TEXT`: on the default job's miniature run a seed
gives the same bytes every time and another seed other bytes; a batch of prompts of different
lengths continues each as it would alone; the KV cache's logits (prefill, then one position a
step) equal one full forward pass of the Transformer at every position, in ep and fsep layouts
and with multi-head latent attention; a tiny Hugging Face Mixtral converted in continues its
prompts greedily as transformers' `generate` does, through its own tokenizer; bad input is
one line naming the value and the fix."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import generate as generate_cli
from moejax.config import ConfigError, MoEConfig, num_moe_layers
from moejax.layout import host_layout as placement_lib
from moejax.layout.migrate import migrate
from moejax.layout.tables import from_placements
from moejax.model import decode
from moejax.model.mesh import mesh_of_shape, replicated
from moejax.train import generation, step as step_lib
from tests import run_helpers
from tests.helpers import TINY_MODEL, TINY_MOE, tiny_setup
from tests.moe_helpers import random_placement, with_local
from tests.numerics import assert_close
from tests.run_config import tiny_config

STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
  """The tiny default-job run of the trainer tests (byte-level, 2 x 4 x 1), 3 steps."""
  run_dir = str(tmp_path_factory.mktemp("generate") / "run")
  run_helpers.run_in_process(tiny_config(run_dir, num_steps=STEPS, every=100))
  return run_dir


@pytest.fixture(scope="module")
def generator(trained) -> generation.Generator:
  return generation.Generator(generate_cli.run_config(trained), trained)


BYTES = generation.Tokenizer("bytes", 256)


def test_a_seed_gives_the_same_bytes_and_another_seed_others(trained, generator):
  assert generator.step == STEPS and generator.where == "one device"
  tokenizer = generation.run_tokenizer(generate_cli.run_config(trained), trained)
  assert tokenizer.name == "bytes" and tokenizer.vocab_size == 256
  sampling = generation.Sampling(temperature=1.0, max_new_tokens=16, seed=1)
  first, again = (generator.complete(["def "], tokenizer, sampling)[0] for _ in range(2))
  other = generator.complete(["def "], tokenizer, dataclasses.replace(sampling, seed=2))[0]
  assert first.prompt_ids == list(b"def ")
  assert len(first.ids) == 16 and all(0 <= t < 256 for t in first.ids) and not first.stopped
  whole = bytes(first.prompt_ids + first.ids).decode("utf-8", errors="replace")
  assert whole.startswith("def ") and first.text == whole[4:]
  assert again.ids == first.ids
  assert other.ids != first.ids
  # top-k 1 and a tiny top-p both keep only the likeliest token: greedy, whatever the seed
  greedy = generator.complete(["def "], tokenizer, dataclasses.replace(sampling, temperature=0))
  for cut in (dict(top_k=1), dict(top_p=1e-6)):
    assert generator.complete(["def "], tokenizer,
                              dataclasses.replace(sampling, **cut))[0].ids == greedy[0].ids


def test_a_batch_continues_each_prompt_as_alone(generator):
  """Prompts of different lengths share the prefill (right-padded, the padding masked) and the
  decode steps (each row at its own position)."""
  prompts = ["x = 1\n", "def f(x): ret", "#"]   # all within one prefill width, one compile
  sampling = generation.Sampling(max_new_tokens=16)   # greedy
  together = generator.complete(prompts, BYTES, sampling)
  alone = [generator.complete([p], BYTES, sampling)[0] for p in prompts]
  assert [c.ids for c in together] == [c.ids for c in alone]


def test_the_runs_mesh_continues_as_one_device(trained, generator):
  """Weights left on the run's 2 x 4 x 1 mesh: XLA partitions the same program, same tokens."""
  on_mesh = generation.Generator(generate_cli.run_config(trained), trained, one_device=False)
  assert on_mesh.where == "the run's mesh (ep/2x4x1/cf1.25)"
  sampling = generation.Sampling(temperature=1.0, max_new_tokens=16, seed=1)
  prompts = ["x = 1\n", "def f(x): ret"]
  assert ([c.ids for c in on_mesh.complete(prompts, BYTES, sampling)] ==
          [c.ids for c in generator.complete(prompts, BYTES, sampling)])


def test_the_cli_prints_each_prompt_and_its_continuation(trained, tmp_path, capsys):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("def \n\nclass A:\n")
  assert generate_cli.main([trained, "--prompt_file", str(prompts), "--max_new_tokens", "8",
                            "--seed", "3"]) == 0
  out, err = capsys.readouterr()
  assert err.splitlines()[-1].startswith(
      f"step {STEPS} of {trained} on one device (bytes tokenizer): 2 prompt(s), 16 tokens in "), err
  first, second = out.split("\n\nclass A:")
  assert first.startswith("def ") and len(first.encode("utf-8", errors="surrogateescape")) >= 4
  assert not os.path.exists(os.path.join(trained, "run.lock"))


def shuffled(moe: MoEConfig, shape, layers: int, seed=0):
  """ep: experts in a random slot order per layer; fsep: random replicas and shares."""
  rng = np.random.default_rng(seed)
  num_experts, devices = moe.num_experts, shape[1]
  if moe.expert_mode == "ep":
    places = [placement_lib.one_copy(rng.permutation(num_experts).astype(np.int32), devices)
              for _ in range(layers)]
    return jax.device_put(from_placements(places, num_experts, 1), replicated(mesh_of_shape(shape)))
  places = [with_local(random_placement(rng, devices, moe.slots_per_device, num_experts), rng)
            for _ in range(layers)]
  return jax.device_put(from_placements(places, num_experts, devices),
                        replicated(mesh_of_shape(shape)))


MLA = dict(num_heads=4, kv_lora_rank=24, q_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12, attention="xla")
# ep: grouped-query attention with QK-norm, a dense first block and a shared expert, experts
# shuffled over 4 devices; fsep: 3 slots per device with random replicas, F split over model;
# mla: DeepSeek's latent attention with the sigmoid gate.
CASES = {
    "ep": ((2, 4, 1), dict(num_kv_heads=2, qk_norm="head"),
           dict(first_dense=1, num_shared_experts=1)),
    "fsep": ((1, 4, 2), {}, dict(expert_mode="fsep", slots_per_device=3)),
    "mla": ((1, 2, 1), MLA, dict(gate="sigmoid", route_scale=2.0)),
}


@pytest.mark.parametrize("case", CASES)
def test_cached_logits_equal_one_full_forward_pass(case):
  shape, model_kw, moe_kw = CASES[case]
  model_cfg = dataclasses.replace(TINY_MODEL, num_layers=5 if "first_dense" in moe_kw else 4,
                                  **model_kw)
  moe_cfg = dataclasses.replace(TINY_MOE, **moe_kw)   # capacity_factor 8: the forward drops none
  mesh, model, _, layout, _, state = tiny_setup(shape, model_cfg, moe_cfg)
  new = shuffled(moe_cfg, shape, num_moe_layers(model_cfg, moe_cfg))
  if moe_cfg.expert_mode == "ep":   # the weights follow the experts to their slots
    state = migrate(state, layout, new)
  bias_LxE = jax.random.normal(jax.random.key(5), new.router_bias_LxE.shape) * 0.05
  routed = step_lib.biased_layout(new, bias_LxE)    # the trained bias chooses too
  batch, seq, prefix = 8, 16, 5
  tokens_BxQ = jax.random.randint(jax.random.key(3), (batch, seq), 0, model_cfg.vocab_size)
  head, stats = jax.jit(model.apply)({"params": state.params}, tokens_BxQ, routed)
  assert int(jnp.sum(stats.dropped_W)) == 0
  want = np.asarray(head.logits())

  params = decode.decode_params(state.params, routed, moe_cfg.expert_mode)
  step = jax.jit(lambda p, t, s, c: decode.forward(p, t, s, c, routed, model_cfg, moe_cfg,
                                                   shape[1]))
  cache = decode.empty_cache(model_cfg, moe_cfg, batch, 32)
  h, cache = step(params, tokens_BxQ[:, :prefix], jnp.zeros(batch, jnp.int32), cache)
  got = [decode.logits(params, h)]
  for i in range(prefix, seq):
    h, cache = step(params, tokens_BxQ[:, i:i + 1], jnp.full(batch, i, jnp.int32), cache)
    got.append(decode.logits(params, h))
  # reductions: embedding -> attention (D, the heads' J, the Q positions) -> MLPs (D, F) per
  # layer, then the unembedding; float32 throughout
  n = model_cfg.num_layers * (3 * model_cfg.d_model + seq + model_cfg.d_ff) + model_cfg.d_model
  assert_close(np.concatenate(got, axis=1), want, n)


def test_sampling_cuts():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 200)
  many = jax.jit(jax.vmap(lambda key, t, k, p: generation.sample(logits, key, t, k, p)[0],
                          in_axes=(0, None, None, None)))
  draw = lambda t=1.0, k=0, p=1.0: set(np.asarray(many(keys, t, k, p)).tolist())
  assert draw() == {0, 1, 2, 3}
  assert draw(k=2) == {0, 1}
  assert draw(p=0.8) == {0, 1}           # 0.5 short of 0.8, 0.5 + 0.3 reaches it
  assert draw(p=0.81) == {0, 1, 2}
  assert draw(k=3, p=0.6) == {0, 1}      # top-p over the top-k's renormalised mass
  assert draw(t=0.0) == {0}
  assert draw(t=0.02) == {0}            # sharpened: the likeliest (odds e^-25 a draw)


@pytest.mark.parametrize("argv, where, fix", [
    (["--prompt", ""], "--prompt ''", "give at least one character"),
    (["--prompt", "x", "--top_p", "1.5"], "--top_p=1.5", "give the probability mass"),
    (["--prompt", "x", "--top_p", "0"], "--top_p=0.0", "give the probability mass"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature=-1.0", "give 0 (greedy)"),
    (["--prompt", "x", "--top_k", "300"], "--top_k=300", "give 0 (no cut)"),
    (["--prompt", "x", "--max_new_tokens", "0"], "--max_new_tokens=0", "e.g. 64"),
    (["--prompt_file", "/nonexistent/p.txt"], "--prompt_file '/nonexistent/p.txt'",
     "one prompt a line"),
    (["--prompt", "x", "--tokenizer", "/nonexistent/t.json"], "--tokenizer", "give a"),
])
def test_bad_input_is_one_line(trained, capsys, argv, where, fix):
  assert generate_cli.main([trained, *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and where in err[0] and fix in err[0], err
  assert not os.path.exists(os.path.join(trained, "run.lock"))


def test_a_missing_or_empty_run_dir_is_one_line(tmp_path, capsys):
  assert generate_cli.main([str(tmp_path / "nothing"), "--prompt", "x"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == (f"error: RUN_DIR {str(tmp_path / 'nothing')!r} does not exist; give a run dir "
                 "that trained or that `python -m moejax.convert from_hf` wrote."), err
  assert not (tmp_path / "nothing").exists()
  assert generate_cli.main([str(tmp_path), "--prompt", "x"]) == 2
  assert "has no config.json" in capsys.readouterr().err


def test_a_token_file_without_a_tokenizer_asks_for_one(tmp_path):
  cfg = tiny_config(tmp_path, num_steps=1, every=1)
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=1000),
                            data=dataclasses.replace(cfg.data, path=str(tmp_path / "t.bin")))
  with pytest.raises(ConfigError, match=r"data.path=.*t\.bin.* give --tokenizer tokenizer.json"):
    generation.run_tokenizer(cfg, str(tmp_path))


# A tiny Mixtral, built and saved by transformers with its own tokenizer (byte-level BPE over a
# few lines, BOS first as Mixtral's adds it), converted in with `moejax.convert`.
def _tokenizer(tokenizers):
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(["def f(x):\n    return x + 1\n", "import os\nprint('hello')\n"] * 4,
                          tokenizers.trainers.BpeTrainer(
                              vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                              initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A",
                                                                special_tokens=[("<s>", 1)])
  return tok


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
  torch = pytest.importorskip("torch", reason="the hf extra is not installed (torch)")
  transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
  tokenizers = pytest.importorskip("tokenizers")
  from moejax.convert import from_hf

  tok = _tokenizer(tokenizers)
  root = tmp_path_factory.mktemp("mixtral")
  config = transformers.MixtralConfig(
      vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
      intermediate_size=32, max_position_embeddings=64, rope_theta=1e6, bos_token_id=1,
      eos_token_id=2)
  torch.manual_seed(0)
  model = transformers.MixtralForCausalLM(config).eval()
  with torch.no_grad():        # weights large enough that routing matters
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else
              0.1 * torch.randn_like(p))
  hf_dir = str(root / "hf")
  model.save_pretrained(hf_dir)
  tok.save(os.path.join(hf_dir, "tokenizer.json"))
  run_dir = str(root / "run")
  cfg = from_hf(hf_dir, run_dir, mesh=(1, 8, 1), dtype="float32")
  return model, run_dir, cfg, tok


def _hf_greedy(model, ids: list[int], new: int) -> list[int]:
  import torch

  model.generation_config.eos_token_id = None     # the full length, as ours without eos
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         pad_token_id=0)
  return out[0, len(ids):].tolist()


def test_a_converted_mixtral_continues_as_transformers_generate(mixtral, capsys):
  model, run_dir, cfg, hf_tok = mixtral
  gen = generation.Generator(cfg, run_dir)
  prompts = [[1, 5, 17, 30, 44], [1, 60, 2, 9, 71, 33, 8, 90, 12]]
  new = 12
  ours = gen.generate_ids(prompts, generation.Sampling(max_new_tokens=new))
  assert len(np.unique(ours)) > 2     # not one token repeated: the comparison says something
  for row, ids in zip(ours.tolist(), prompts):
    assert row == _hf_greedy(model, ids, new), ids
  # the command: the run's own tokenizer (RUN_DIR/hf), stopping at its end-of-sequence token
  text = "def f(x):"
  assert generate_cli.main([run_dir, "--prompt", text, "--temperature", "0",
                            "--max_new_tokens", str(new)]) == 0
  out, err = capsys.readouterr()
  assert "(" + os.path.join(run_dir, "hf", "tokenizer.json") + " tokenizer)" in err, err
  ids = hf_tok.encode(text).ids
  assert ids[0] == 1
  want = _hf_greedy(model, ids, new)
  if 2 in want:
    want = want[:want.index(2)]
  prompt_text = hf_tok.decode(ids, skip_special_tokens=True)
  assert out == text + hf_tok.decode(ids + want, skip_special_tokens=True)[len(prompt_text):] + \
      "\n"


def test_a_tokenizer_larger_than_the_model_is_one_line(trained, tmp_path, capsys):
  tokenizers = pytest.importorskip("tokenizers")
  path = str(tmp_path / "tokenizer.json")
  _tokenizer(tokenizers).save(path)
  assert generate_cli.main([trained, "--prompt", "x", "--tokenizer", path]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"the tokenizer {path} has " in err[0], err
  assert "model.vocab_size=256; give the tokenizer the run's data was encoded with" in err[0]
