"""Text sampled from a run dir's latest intact checkpoint: the run's tokenizer, greedy /
temperature / top-k / top-p sampling with a seed, and the decode loop over the model's KV
cache (`moejax.model.decode`).

The checkpoint is read as `moejax.train.evaluation` reads it (the caller holds the run dir's
lock), then decoded on one device where the weights fit in three quarters of its memory, else
left on the run's mesh, where XLA partitions the same program over the weights' shardings. One
jitted program prefills the batch of prompts (right-padded to a multiple of 16 tokens, each
row's padding masked and then overwritten by its own tokens) and runs the decode step under
`lax.while_loop` until every row has its `max_new_tokens` or an end-of-sequence token; the
cache holds prompt + max_new_tokens positions rounded up to 64, so one compile serves every
step and every batch of prompts of similar length.

Sampling, per step and row, as Hugging Face's `generate` orders it: logits / temperature, then
the top-k, then the smallest set of tokens whose probability reaches top-p; temperature 0 is
greedy. The key of step i is `fold_in(PRNGKey(seed), i)`: a seed gives the same text every
time, on any device count.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import Config, ConfigError
from moejax.model import decode
from moejax.train import data as data_lib, evaluation, step as step_lib

__all__ = ["Completion", "Generator", "Sampling", "Tokenizer", "run_tokenizer", "sample"]

PROMPT_ROUND, CACHE_ROUND = 16, 64
TOKENIZER_FILE = "tokenizer.json"
HF_DIR = "hf"   # where `python -m moejax.convert from_hf` keeps the model's own files


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0    # 0: greedy
  top_k: int = 0              # 0: no cut
  top_p: float = 1.0          # 1: no cut
  max_new_tokens: int = 64
  seed: int = 0

  def check(self, vocab_size: int) -> Sampling:
    """One line per knob out of range, naming the value and the fix."""
    if not self.temperature >= 0:   # NaN too
      raise ConfigError(f"--temperature={self.temperature} is negative; give 0 (greedy) or a "
                        "positive temperature, e.g. 0.8.")
    if not 0 <= self.top_k <= vocab_size:
      raise ConfigError(f"--top_k={self.top_k} is outside 0..{vocab_size} (the model's "
                        "vocabulary); give 0 (no cut) or a count of tokens to keep, e.g. 40.")
    if not 0 < self.top_p <= 1:
      raise ConfigError(f"--top_p={self.top_p} is outside (0, 1]; give the probability mass "
                        "to keep, e.g. 0.9 (1: no cut).")
    if self.max_new_tokens < 1:
      raise ConfigError(f"--max_new_tokens={self.max_new_tokens} must be >= 1; give how many "
                        "tokens to sample after each prompt, e.g. 64.")
    return self


def sample(logits_Bxvocab: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
  """int32 [B]: one token per row (the knobs may be traced: one compile serves them all)."""
  logits_Bxvocab = logits_Bxvocab.astype(jnp.float32)
  greedy_B = jnp.argmax(logits_Bxvocab, axis=-1)
  scaled_Bxvocab = logits_Bxvocab / jnp.maximum(temperature, 1e-6)
  sorted_Bxvocab = -jnp.sort(-scaled_Bxvocab, axis=-1)   # descending
  vocab = logits_Bxvocab.shape[-1]
  kth_Bx1 = jnp.take(sorted_Bxvocab, jnp.clip(top_k - 1, 0, vocab - 1), axis=-1)[:, None]
  cut_Bxvocab = jnp.where(top_k > 0, scaled_Bxvocab < kth_Bx1, False)
  scaled_Bxvocab = jnp.where(cut_Bxvocab, -jnp.inf, scaled_Bxvocab)
  sorted_Bxvocab = jnp.where(jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab), sorted_Bxvocab,
                         -jnp.inf)
  probs_Bxvocab = jax.nn.softmax(sorted_Bxvocab, axis=-1)
  # keep a token while the mass before it is short of top_p (the first is always kept)
  kept_Bxvocab = jnp.cumsum(probs_Bxvocab, axis=-1) - probs_Bxvocab < top_p
  floor_Bx1 = jnp.min(jnp.where(kept_Bxvocab, sorted_Bxvocab, jnp.inf), axis=-1, keepdims=True)
  scaled_Bxvocab = jnp.where(scaled_Bxvocab < floor_Bx1, -jnp.inf, scaled_Bxvocab)
  sampled_B = jax.random.categorical(key, scaled_Bxvocab, axis=-1)
  return jnp.where(temperature > 0, sampled_B, greedy_B).astype(jnp.int32)


class Tokenizer:
  """Text <-> ids: bytes (the default job's, `hf` None) or a Hugging Face tokenizer.json."""

  def __init__(self, name: str, vocab_size: int, hf=None, eos_ids: tuple[int, ...] = ()):
    self.name, self.vocab_size, self.hf, self.eos_ids = name, vocab_size, hf, eos_ids

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8")) if self.hf is None else self.hf.encode(text).ids

  def decode(self, ids) -> str:
    if self.hf is None:
      return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
    return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

  def continuation(self, prompt_ids, ids) -> str:
    """The text `ids` add after the prompt: decoded together with it, as a decoder may join
    tokens across the boundary (a word-start marker's space, a UTF-8 character split in two),
    less the prompt's own text."""
    whole, prompt = self.decode(list(prompt_ids) + list(ids)), self.decode(prompt_ids)
    return whole[len(prompt):] if whole.startswith(prompt) else self.decode(ids)


def _hf_tokenizer(path: str, eos_ids: tuple[int, ...] = ()) -> Tokenizer:
  from tokenizers import Tokenizer as HFTokenizer

  try:
    tok = HFTokenizer.from_file(path)
  except Exception as e:   # tokenizers raises a bare Exception on a malformed file
    raise ConfigError(f"--tokenizer {path!r} is not a tokenizer.json ({str(e).splitlines()[0]}); "
                      "give the tokenizer.json the run's data was prepared with.") from None
  return Tokenizer(path, tok.get_vocab_size(with_added_tokens=True), tok, eos_ids)


def _eos_ids(hf_dir: str) -> tuple[int, ...]:
  """The end-of-sequence ids of a converted model (generation_config.json, else config.json)."""
  for name in ("generation_config.json", "config.json"):
    path = os.path.join(hf_dir, name)
    if os.path.isfile(path):
      with open(path) as f:
        eos = json.load(f).get("eos_token_id")
      if eos is not None:
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
  return ()


def run_tokenizer(cfg: Config, run_dir: str, path: str | None = None) -> Tokenizer:
  """The tokenizer of the run: `path` if given; a converted model's own (RUN_DIR/hf); the one
  its prepared data directory was made with; bytes where its data is byte-level. Its ids must
  be the model's (a model's vocabulary may be padded past them)."""
  tokenizer = _find_tokenizer(cfg, run_dir, path)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"the tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but the "
                      f"run's model.vocab_size={cfg.model.vocab_size}; give the tokenizer the "
                      "run's data was encoded with (--tokenizer).")
  return tokenizer


def _find_tokenizer(cfg: Config, run_dir: str, path: str | None) -> Tokenizer:
  hf_dir = os.path.join(run_dir, HF_DIR)
  if path is not None:
    if not os.path.isfile(path):
      raise ConfigError(f"--tokenizer {path!r} does not exist; give a tokenizer.json file.")
    return _hf_tokenizer(path, _eos_ids(hf_dir))
  if os.path.isfile(os.path.join(hf_dir, TOKENIZER_FILE)):
    return _hf_tokenizer(os.path.join(hf_dir, TOKENIZER_FILE), _eos_ids(hf_dir))
  data = cfg.data.path
  if data is not None and os.path.isdir(data):
    if data_lib.read_meta(data).get("tokenizer"):
      return _hf_tokenizer(os.path.join(data, TOKENIZER_FILE))
    return Tokenizer("bytes", data_lib.BYTE_VOCAB)
  if data is None or cfg.model.vocab_size <= data_lib.BYTE_VOCAB:   # the byte corpus, text
    return Tokenizer("bytes", data_lib.BYTE_VOCAB)
  raise ConfigError(f"the run's data.path={data!r} is a token file with no tokenizer beside it "
                    f"(model.vocab_size={cfg.model.vocab_size}); give --tokenizer tokenizer.json, "
                    "the one it was encoded with.")


@dataclasses.dataclass
class Completion:
  prompt: str
  prompt_ids: list[int]
  ids: list[int]           # the sampled tokens, an end-of-sequence token excluded
  text: str                # the continuation (`Tokenizer.continuation`)
  stopped: bool            # ended at an end-of-sequence token before max_new_tokens


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _fits_one_device(tree, device) -> bool:
  """The tree's bytes within the device's memory (with a quarter spare for activations);
  a device that reports no limit (CPU) is taken to fit."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  limit = (stats or {}).get("bytes_limit")
  size = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))
  return limit is None or size <= 0.75 * limit


class Generator:
  """A run's latest intact checkpoint, ready to decode (`complete`, `generate_ids`)."""

  def __init__(self, cfg: Config, run_dir: str, devices=None, one_device: bool | None = None):
    """`one_device` None: one device where the weights fit, else the run's mesh; True or
    False: that."""
    devices = list(jax.devices() if devices is None else devices)
    prog, state, layout, self.step, self.warnings = evaluation.restore(cfg, run_dir, devices)
    self.cfg = prog.cfg
    self.expert_devices = prog.mesh.shape["expert"]
    layout = step_lib.biased_layout(layout, state.router_bias_LxE)   # routes as trained
    params = decode.decode_params(state.params, layout, prog.expert_mode)
    self.where = f"the run's mesh ({prog.strategy.spec})"
    if one_device if one_device is not None else _fits_one_device(params, devices[0]):
      params, layout = jax.device_put((params, layout), devices[0])
      self.where = "one device"
    self.params, self.layout = params, layout
    self._compiled = {}

  def _program(self, max_new: int, cache_len: int):
    key = (max_new, cache_len)
    if key not in self._compiled:
      self._compiled[key] = jax.jit(
          lambda *args: _generate(*args, cfg=self.cfg, expert_devices=self.expert_devices,
                                  max_new=max_new, cache_len=cache_len))
    return self._compiled[key]

  def generate_ids(self, prompts: list[list[int]], sampling: Sampling,
                   vocab_limit: int = 0, eos_ids: tuple[int, ...] = ()) -> np.ndarray:
    """int32 [len(prompts), max_new_tokens]: the sampled tokens of each prompt (after an
    end-of-sequence token, that token again). `vocab_limit` > 0 samples only ids below it
    (a tokenizer smaller than the model's padded vocabulary)."""
    vocab = self.cfg.model.vocab_size
    sampling.check(vocab)
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ConfigError("a prompt encodes to no tokens; give at least one character of text.")
    if any(not 0 <= t < vocab for p in prompts for t in p):
      raise ConfigError(f"a prompt token is outside the model's vocabulary 0..{vocab - 1}; "
                        "give the run's own tokenizer (--tokenizer).")
    width = _round_up(max(len(p) for p in prompts), PROMPT_ROUND)
    cache_len = _round_up(width + sampling.max_new_tokens, CACHE_ROUND)
    prompt_BxQ = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
      prompt_BxQ[row, :len(p)] = p
    length_B = np.array([len(p) for p in prompts], np.int32)
    eos = np.array(eos_ids or (-1,), np.int32)
    out = self._program(sampling.max_new_tokens, cache_len)(
        self.params, self.layout, prompt_BxQ, length_B, jax.random.key(sampling.seed),
        np.float32(sampling.temperature), np.int32(sampling.top_k),
        np.float32(sampling.top_p), np.int32(vocab_limit or vocab), eos)
    return np.asarray(jax.device_get(out))

  def complete(self, prompts: list[str], tokenizer: Tokenizer,
               sampling: Sampling) -> list[Completion]:
    """Each prompt's continuation, decoded by `tokenizer` (sampled among its ids only)."""
    for text in prompts:
      if not text:
        raise ConfigError("--prompt '' is empty; give at least one character of text to "
                          "continue.")
    ids = [tokenizer.encode(text) for text in prompts]
    out = self.generate_ids(ids, sampling, min(tokenizer.vocab_size, self.cfg.model.vocab_size),
                            tokenizer.eos_ids)
    done = []
    for text, prompt_ids, row in zip(prompts, ids, out.tolist()):
      stop = next((i for i, t in enumerate(row) if t in tokenizer.eos_ids), len(row))
      done.append(Completion(text, prompt_ids, row[:stop],
                             tokenizer.continuation(prompt_ids, row[:stop]), stop < len(row)))
    return done


def _generate(params, layout, prompt_BxQ, length_B, key, temperature, top_k, top_p,
              vocab_limit, eos_N, *, cfg: Config, expert_devices: int, max_new: int,
              cache_len: int):
  """Prefill, then the decode step under `lax.while_loop`: int32 [B, max_new]."""
  model, moe = cfg.model, cfg.moe
  batch = prompt_BxQ.shape[0]
  rows_B = jnp.arange(batch)

  def next_token(h_BxD, i):
    logits_Bxvocab = decode.logits(params, h_BxD[:, None])[:, 0]
    known_vocab = jnp.arange(logits_Bxvocab.shape[-1]) < vocab_limit
    logits_Bxvocab = jnp.where(known_vocab, logits_Bxvocab, -jnp.inf)
    return sample(logits_Bxvocab, jax.random.fold_in(key, i), temperature, top_k, top_p)

  cache = decode.empty_cache(model, moe, batch, cache_len)
  h_BxQxD, cache = decode.forward(params, prompt_BxQ, jnp.zeros_like(length_B), cache, layout,
                                  model, moe, expert_devices)
  token_B = next_token(h_BxQxD[rows_B, length_B - 1], 0)
  out_BxN = jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(token_B)
  done_B = jnp.isin(token_B, eos_N)

  def body(carry):
    i, token_B, cache, out_BxN, done_B = carry
    h_Bx1xD, cache = decode.forward(params, token_B[:, None], length_B + i - 1, cache, layout,
                                    model, moe, expert_devices)
    new_B = jnp.where(done_B, token_B, next_token(h_Bx1xD[:, 0], i))
    return i + 1, new_B, cache, out_BxN.at[:, i].set(new_B), done_B | jnp.isin(new_B, eos_N)

  def more(carry):
    i, _, _, _, done_B = carry
    return (i < max_new) & ~jnp.all(done_B)

  i, token_B, _, out_BxN, _ = jax.lax.while_loop(more, body, (1, token_B, cache, out_BxN, done_B))
  # rows that stopped early: the end-of-sequence token repeated past the stop
  return jnp.where(jnp.arange(max_new)[None] < i, out_BxN, token_B[:, None])
