"""The tokenizers of the data step, behind one small interface: `vocab_size`, `separator`
(the ids written before each file) and `encode(list of byte chunks) -> list of id arrays`.

Byte-level BPE (Hugging Face `tokenizers`) is lossless on UTF-8: decoding a chunk's ids gives
its text back. Bytes that are not UTF-8 are read as U+FFFD first (`--bytes` keeps them all).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from moejax.config import ConfigError
from moejax.train.data import BYTE_VOCAB, SEPARATOR

END_OF_TEXT = "<|endoftext|>"   # the separator token a trained BPE gets, as id 0


class ByteEncoder:
  """Raw bytes: ids 0..255, files separated by the embedded corpus's SEPARATOR bytes."""
  kind = "bytes"
  vocab_size = BYTE_VOCAB
  separator = tuple(SEPARATOR)
  tokenizer = None

  def encode(self, chunks: list[bytes]) -> list[np.ndarray]:
    return [np.frombuffer(c, np.uint8) for c in chunks]


class HFEncoder:
  """A Hugging Face `tokenizers.Tokenizer`; files are separated by its END_OF_TEXT token
  when it has one, else by the model's end and start tokens (`model`: the config.json of the
  model the tokenizer belongs to), else by nothing. A model's vocab_size (its embedding rows,
  often padded past the tokenizer's ids) is the data's."""

  def __init__(self, tokenizer, kind: str, model: dict | None = None):
    self.tokenizer = tokenizer
    self.kind = kind
    model = model or {}
    self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True),
                          int(model.get("vocab_size") or 0))
    eot = tokenizer.token_to_id(END_OF_TEXT)
    ends = [model.get("eos_token_id"), model.get("bos_token_id")]
    self.separator = (eot,) if eot is not None else tuple(i for i in ends if isinstance(i, int))

  def encode(self, chunks: list[bytes]) -> list[np.ndarray]:
    texts = [c.decode("utf-8", errors="replace") for c in chunks]
    # The fast variant skips character offsets: ~200 bytes per token held instead of ~300.
    encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
    return [np.asarray(e.ids, np.int64) for e in encode(texts, add_special_tokens=False)]


def load_encoder(path: str) -> HFEncoder:
  """A tokenizer.json file (what `tokenizers` saves and the Hugging Face hub serves); a
  config.json beside it (a model's directory) gives the vocab size and special tokens."""
  import json

  from tokenizers import Tokenizer

  if not os.path.isfile(path):
    raise ConfigError(f"--tokenizer {path!r} does not exist; give a tokenizer.json file, or "
                      "--train_bpe VOCAB to train one on the input, or --bytes.")
  try:
    tokenizer = Tokenizer.from_file(path)
  except Exception as e:   # tokenizers raises a bare Exception on a malformed file
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(f"--tokenizer {path!r} is not a tokenizer.json ({first}).") from None
  model_config = os.path.join(os.path.dirname(path), "config.json")
  model = None
  if os.path.isfile(model_config):
    with open(model_config) as f:
      model = json.load(f)
  return HFEncoder(tokenizer, "tokenizer.json", model)


def train_bpe(texts: Iterable[bytes], vocab_size: int, length: int | None = None) -> HFEncoder:
  """A byte-level BPE of `vocab_size` ids (END_OF_TEXT is id 0, the 256 byte symbols follow)
  trained on the streamed `texts`; the trainer keeps word counts, not the text."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 1:
    raise ConfigError(f"--train_bpe {vocab_size} is too small: a byte-level BPE needs "
                      f"{len(alphabet) + 1} ids for the bytes and {END_OF_TEXT}; use e.g. 4096.")
  if vocab_size > 2**32:
    raise ConfigError(f"--train_bpe {vocab_size} does not fit uint32 token files; use <= 2**32.")
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                initial_alphabet=alphabet, show_progress=False)
  tokenizer.train_from_iterator((t.decode("utf-8", errors="replace") for t in texts),
                                trainer=trainer, length=length)
  return HFEncoder(tokenizer, "bpe")
