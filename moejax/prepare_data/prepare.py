"""One prepared token directory from text files: (train a BPE on them,) encode, split, write."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from moejax.config import ConfigError
from moejax.prepare_data.encoders import ByteEncoder, load_encoder, train_bpe
from moejax.prepare_data.sources import CHUNK_BYTES, Chunk, input_files, stream_chunks
from moejax.train.data import META_FILE, TRAIN_BIN, VAL_BIN, bin_dtype_for

TOKENIZER_FILE = "tokenizer.json"
# Chunks encoded together (tokenizers spreads a batch over cores); the encodings of a batch,
# not the input's size, set the peak memory (~200 bytes per token while encoding).
_BATCH_BYTES = 8 * CHUNK_BYTES


def _batches(chunks: Iterator[Chunk]) -> Iterator[list[Chunk]]:
  batch, size = [], 0
  for chunk in chunks:
    batch.append(chunk)
    size += len(chunk.data)
    if size >= _BATCH_BYTES:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def _progress(files: list[str], desc: str, enabled: bool) -> tqdm:
  total = sum(os.path.getsize(p) for p in files)
  return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled,
              dynamic_ncols=True)


def _check_out(out: str) -> None:
  taken = [n for n in (META_FILE, TRAIN_BIN, VAL_BIN, TOKENIZER_FILE)
           if os.path.exists(os.path.join(out, n))]
  if taken:
    raise ConfigError(f"--out {out!r} already holds {', '.join(taken)}; give a new directory "
                      "or delete those files yourself (nothing is overwritten).")


def prepare(pattern: str, out: str, *, tokenizer: str | None = None,
            bpe_vocab: int | None = None, byte_level: bool = False, val_fraction: float = 0.05,
            exclude: tuple[str, ...] = (), progress: bool = True,
            chunk_bytes: int | None = None) -> dict:
  """Writes `out`/{train.bin, val.bin, meta.json} (and tokenizer.json unless byte-level) from
  the files matching `pattern`; returns the meta. Exactly one of `tokenizer` (a tokenizer.json),
  `bpe_vocab` (train a byte-level BPE of that size on the input) or `byte_level`. meta.json is
  written last, so a directory is usable only once complete."""
  if sum([tokenizer is not None, bpe_vocab is not None, byte_level]) != 1:
    raise ConfigError("give exactly one of --tokenizer FILE, --train_bpe VOCAB or --bytes.")
  if not 0.0 < val_fraction < 1.0:
    raise ConfigError(f"--val_fraction {val_fraction} must be in (0, 1); use e.g. 0.05.")
  _check_out(out)
  files = input_files(pattern, exclude, skip_dir=out)
  root = os.path.commonpath([os.path.abspath(p) for p in files])
  root = os.path.dirname(root) if os.path.isfile(root) else root

  def chunks():
    return stream_chunks(files, val_fraction, root, chunk_bytes)

  if byte_level:
    encoder = ByteEncoder()
  elif tokenizer is not None:
    encoder = load_encoder(tokenizer)
  else:
    with _progress(files, "train BPE", progress) as bar:
      def train_texts():
        for c in chunks():
          bar.update(len(c.data))
          if not c.val:   # the validation text stays unseen, as in training
            yield c.data
      encoder = train_bpe(train_texts(), bpe_vocab)
  dtype = np.dtype(bin_dtype_for(encoder.vocab_size))
  os.makedirs(out, exist_ok=True)
  paths = {False: os.path.join(out, TRAIN_BIN), True: os.path.join(out, VAL_BIN)}
  counts = {False: 0, True: 0}
  separator = np.asarray(encoder.separator, np.int64)
  try:
    with open(paths[False] + ".tmp", "wb") as f_train, open(paths[True] + ".tmp", "wb") as f_val, \
        _progress(files, "tokenize", progress) as bar:
      sinks = {False: f_train, True: f_val}
      for batch in _batches(chunks()):
        for chunk, ids in zip(batch, encoder.encode([c.data for c in batch])):
          ids = np.concatenate([separator, ids]) if chunk.first else ids
          if len(ids) and (ids.min() < 0 or ids.max() >= encoder.vocab_size):
            raise ConfigError(f"the tokenizer gave id {int(ids.max())} outside its vocab_size="
                              f"{encoder.vocab_size}; check --tokenizer.")
          sinks[chunk.val].write(ids.astype(dtype).tobytes())
          counts[chunk.val] += len(ids)
          bar.update(len(chunk.data))
    if not counts[True] or not counts[False]:
      raise ConfigError(f"the {len(files)} input files ({sum(map(os.path.getsize, files))} "
                        f"bytes) gave {counts[False]} train and {counts[True]} val tokens, too "
                        "little text to make two chunks (8 KiB); both splits need some: give "
                        "more text.")
    for split in (False, True):
      os.replace(paths[split] + ".tmp", paths[split])
  finally:
    for split in (False, True):
      if os.path.exists(paths[split] + ".tmp"):
        os.remove(paths[split] + ".tmp")
  if encoder.tokenizer is not None:
    if tokenizer is not None:
      shutil.copyfile(tokenizer, os.path.join(out, TOKENIZER_FILE))
    else:
      encoder.tokenizer.save(os.path.join(out, TOKENIZER_FILE))
  meta = {
      "vocab_size": encoder.vocab_size, "dtype": dtype.name,
      "tokenizer_vocab_size": None if encoder.tokenizer is None else
      encoder.tokenizer.get_vocab_size(with_added_tokens=True),
      "train_tokens": counts[False], "val_tokens": counts[True],
      "tokenizer": None if encoder.tokenizer is None else TOKENIZER_FILE,
      "tokenizer_kind": encoder.kind, "tokenizer_source": tokenizer,
      "separator": [int(i) for i in encoder.separator],
      "input": pattern, "exclude": list(exclude), "files": len(files),
      "bytes": sum(os.path.getsize(p) for p in files), "val_fraction": val_fraction,
  }
  with open(os.path.join(out, META_FILE) + ".tmp", "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(os.path.join(out, META_FILE) + ".tmp", os.path.join(out, META_FILE))
  return meta


__all__ = ["TOKENIZER_FILE", "prepare"]
