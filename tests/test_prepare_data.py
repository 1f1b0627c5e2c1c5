"""The data step (moejax.prepare_data): text files -> a prepared token directory that the
trainer reads with its vocab size and dtype. Host only; the tokenizers train in well under
a second on the few kilobytes here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from moejax import frontend
from moejax.config import Config, ConfigError, DataConfig, ModelConfig
from moejax.prepare_data import __main__ as cli, prepare
from moejax.prepare_data.encoders import END_OF_TEXT
from moejax.prepare_data.sources import stream_chunks
from moejax.train import data

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega — ünïcödé ✓").split()


def _texts(tmp_path, files: int = 24, lines: int = 30) -> dict[str, bytes]:
  """Small deterministic text files in nested folders; returns {relative path: bytes}."""
  rng = np.random.default_rng(0)
  out = {}
  for i in range(files):
    rel = f"d{i % 3}/sub/f{i:02d}.txt"
    text = "".join(" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) + "\n"
                   for _ in range(lines)).encode()
    (tmp_path / "in" / os.path.dirname(rel)).mkdir(parents=True, exist_ok=True)
    (tmp_path / "in" / rel).write_bytes(text)
    out[rel] = text
  return out


def _read(out_dir, name, meta):
  return np.fromfile(os.path.join(out_dir, name), dtype=meta["dtype"])


def _expected_splits(texts: dict[str, bytes], val_fraction: float, sep: bytes):
  """What the bytes of each split must be: files in sorted order, each chunk by its hash."""
  parts = {False: [], True: []}
  for chunk in stream_chunks([str(p) for p in sorted(texts)], val_fraction, root="."):
    parts[chunk.val].append((sep if chunk.first else b"") + chunk.data)
  return b"".join(parts[False]), b"".join(parts[True])


def test_bytes_round_trip(tmp_path, monkeypatch):
  texts = _texts(tmp_path)
  out = tmp_path / "out"
  meta = prepare(str(tmp_path / "in" / "**" / "*.txt"), str(out), byte_level=True,
                 val_fraction=0.2, progress=False)
  assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16" and meta["files"] == len(texts)
  assert json.loads((out / "meta.json").read_text()) == meta
  monkeypatch.chdir(tmp_path / "in")
  want_train, want_val = _expected_splits(texts, 0.2, data.SEPARATOR)
  train, val = _read(out, "train.bin", meta), _read(out, "val.bin", meta)
  assert bytes(train.astype(np.uint8)) == want_train and bytes(val.astype(np.uint8)) == want_val
  assert len(val) and len(train)
  assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))


def test_trained_bpe_is_lossless_and_reloadable(tmp_path):
  texts = _texts(tmp_path)
  pattern = str(tmp_path / "in" / "**" / "*.txt")
  meta = prepare(pattern, str(tmp_path / "bpe"), bpe_vocab=400, val_fraction=0.2, progress=False)
  assert meta["vocab_size"] <= 400 and meta["dtype"] == "uint16"
  assert meta["tokenizer"] == "tokenizer.json" and meta["separator"] == [0]
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
  assert tok.token_to_id(END_OF_TEXT) == 0
  train = _read(tmp_path / "bpe", "train.bin", meta)
  # BPE merges words, so it needs fewer tokens than bytes; decoding gives the text back.
  assert len(train) < sum(len(t) for t in texts.values()) * 0.8
  docs = tok.decode(train.tolist(), skip_special_tokens=False).split(END_OF_TEXT)
  assert docs[0] == "" and set(docs[1:]) <= {t.decode() for t in texts.values()}
  # Encoding with the saved tokenizer.json gives the same tokens.
  saved = str(tmp_path / "bpe" / "tokenizer.json")
  again = prepare(pattern, str(tmp_path / "again"), tokenizer=saved, val_fraction=0.2,
                  progress=False)
  np.testing.assert_array_equal(_read(tmp_path / "again", "train.bin", again), train)
  assert again["tokenizer_kind"] == "tokenizer.json"


def test_chunks_keep_memory_bounded_and_split_large_files(tmp_path):
  text = b"".join(b"line %d of one long file\n" % i for i in range(3000))
  (tmp_path / "big.txt").write_bytes(text)
  chunks = list(stream_chunks([str(tmp_path / "big.txt")], 0.3, chunk_bytes=4096))
  assert len(chunks) > 10 and all(len(c.data) <= 4096 for c in chunks)
  assert all(c.data.endswith(b"\n") for c in chunks) and b"".join(c.data for c in chunks) == text
  assert {c.val for c in chunks} == {False, True}   # one file still gives both splits
  meta = prepare(str(tmp_path / "big.txt"), str(tmp_path / "out"), byte_level=True,
                 val_fraction=0.3, progress=False, chunk_bytes=4096)
  assert meta["train_tokens"] + meta["val_tokens"] == len(text) + len(data.SEPARATOR)


def test_trainer_reads_vocab_and_dtype_from_meta(tmp_path):
  _texts(tmp_path)
  out = str(tmp_path / "out")
  meta = prepare(str(tmp_path / "in" / "**" / "*.txt"), out, bpe_vocab=300, val_fraction=0.2,
                 progress=False)
  cfg = DataConfig(path=out, seq_len=16, bin_dtype="uint32")   # a directory's own dtype wins
  train, val, vocab = data.load_tokens(cfg)
  assert vocab == meta["vocab_size"] and train.dtype == np.uint16
  assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
  parsed = frontend.parse_config([frontend.DEFAULT_GIN], [f"data.path = '{out}'"])
  assert parsed.model.vocab_size == meta["vocab_size"]   # default.gin: 0, the data's
  with pytest.raises(ConfigError) as e:
    frontend.parse_config([frontend.DEFAULT_GIN], [f"data.path = '{out}'",
                                                   "model.vocab_size = 256"])
  msg = str(e.value)
  assert "\n" not in msg and "model.vocab_size=256" in msg and f"vocab_size={vocab}" in msg
  both = Config(model=ModelConfig(vocab_size=0), data=cfg)
  assert data.resolve_vocab(both, vocab).model.vocab_size == vocab
  assert data.bin_dtype_for(65536) == "uint16" and data.bin_dtype_for(65537) == "uint32"


def test_errors_are_one_line_and_nothing_is_overwritten(tmp_path, capsys):
  _texts(tmp_path, files=6)
  pattern = str(tmp_path / "in" / "**" / "*.txt")
  out = tmp_path / "out"
  prepare(pattern, str(out), byte_level=True, val_fraction=0.5, progress=False)
  before = (out / "train.bin").read_bytes()
  cases = [
      (["--input", pattern, "--out", str(out), "--bytes"], "already holds"),
      (["--input", str(tmp_path / "none" / "*.txt"), "--out", str(tmp_path / "o2"), "--bytes"],
       "matches no files"),
      (["--input", pattern, "--out", str(tmp_path / "o3"), "--train_bpe", "100"], "too small"),
      (["--input", pattern, "--out", str(tmp_path / "o4"), "--tokenizer", "nope.json"],
       "does not exist"),
      (["--input", pattern, "--out", str(tmp_path / "o6"), "--train_bpe", "0"], "too small"),
      # One file of one chunk (under 8 KiB) cannot make two splits, whatever the fraction.
      (["--input", str(tmp_path / "in" / "d0" / "sub" / "f00.txt"), "--out", str(tmp_path / "o5"),
        "--bytes", "--val_fraction", "0.5"], "both splits"),
  ]
  for argv, needle in cases:
    assert cli.main(argv + ["--no_progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err
  assert (out / "train.bin").read_bytes() == before
  assert not os.path.exists(tmp_path / "o5" / "meta.json")
  with pytest.raises(ConfigError, match="meta.json"):
    data.load_tokens(DataConfig(path=str(tmp_path / "in")))


def test_one_big_file_is_split_by_chunk(tmp_path):
  """The most common input, one corpus.txt: its chunks go to both splits (by hash, and the
  last chunk to the split the hash left empty), and the bytes of both add up to the file."""
  rng = np.random.default_rng(1)
  text = "".join(" ".join(rng.choice(WORDS, size=8)) + "\n" for _ in range(4000)).encode()
  (tmp_path / "corpus.txt").write_bytes(text)
  for val_fraction, out in ((0.05, "a"), (1e-6, "b")):   # b: the hash picks no val chunk
    meta = prepare(str(tmp_path / "corpus.txt"), str(tmp_path / out), byte_level=True,
                   val_fraction=val_fraction, progress=False)
    train = bytes(_read(tmp_path / out, "train.bin", meta).astype(np.uint8))
    val = bytes(_read(tmp_path / out, "val.bin", meta).astype(np.uint8))
    assert meta["train_tokens"] > 0 and meta["val_tokens"] > 0, meta
    assert len(train) + len(val) == len(text) + len(data.SEPARATOR)
    assert val in text and train.startswith(data.SEPARATOR)   # val: whole chunks, in order
    assert meta["val_tokens"] < len(text) / 4   # a share near the fraction, not half
