"""Tests of moejax.data: the embedded corpus, token files, and the batch loader."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moejax.config import ConfigError, DataConfig
from moejax.train import data

MAX_BYTES = 200_000


@pytest.fixture(scope="module")
def corpus():
  return data.embedded_corpus(MAX_BYTES)


def test_embedded_corpus_is_deterministic_bytes(corpus):
  train, val = corpus
  assert train.dtype == np.uint8 and val.dtype == np.uint8
  assert train.ndim == 1 and val.ndim == 1
  assert len(train) > 0 and len(val) > 0
  assert len(train) + len(val) <= MAX_BYTES
  assert len(train) + len(val) > MAX_BYTES // 2
  train2, val2 = data.embedded_corpus(MAX_BYTES)
  np.testing.assert_array_equal(train, train2)
  np.testing.assert_array_equal(val, val2)
  assert bytes(train[:len(data.SEPARATOR)]) == data.SEPARATOR


def test_embedded_corpus_splits_by_file(corpus):
  train, val = corpus
  root, rel_paths = data.stdlib_sources()
  assert rel_paths == sorted(rel_paths)
  assert not any("site-packages" in p.split("/") for p in rel_paths)
  val_paths = [p for p in rel_paths if data.is_val_file(p, 0.05)]
  train_paths = [p for p in rel_paths if not data.is_val_file(p, 0.05)]
  assert val_paths and train_paths and not set(val_paths) & set(train_paths)
  # Each split starts with the first file of its kind, whole (or truncated to the budget).
  for tokens, paths in ((train, train_paths), (val, val_paths)):
    with open(os.path.join(root, paths[0]), "rb") as f:
      expected = (data.SEPARATOR + f.read())[:len(tokens)]
    assert bytes(tokens[:len(expected)]) == expected
  # The split is a stable function of the path, so a bigger fraction keeps the smaller's files.
  assert set(val_paths) <= {p for p in rel_paths if data.is_val_file(p, 0.2)}


def test_load_tokens_embedded(corpus):
  train, val, vocab = data.load_tokens(DataConfig(max_corpus_bytes=MAX_BYTES, seq_len=32))
  assert vocab == 256
  np.testing.assert_array_equal(train, corpus[0])
  np.testing.assert_array_equal(val, corpus[1])


def _split(stream, val_fraction=0.05):
  n_val = int(len(stream) * val_fraction)
  return stream[:len(stream) - n_val], stream[len(stream) - n_val:]


def test_load_npy(tmp_path):
  stream = np.arange(1000, dtype=np.int32) % 777
  path = tmp_path / "tokens.npy"
  np.save(path, stream)
  train, val, vocab = data.load_tokens(DataConfig(path=str(path), seq_len=8))
  assert vocab == 777
  want_train, want_val = _split(stream)
  np.testing.assert_array_equal(train, want_train)
  np.testing.assert_array_equal(val, want_val)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_load_bin(tmp_path, dtype):
  stream = (np.arange(2000, dtype=np.int64) * 7919 % 70000).astype(dtype)
  path = tmp_path / "tokens.bin"
  stream.tofile(path)
  train, val, vocab = data.load_tokens(DataConfig(path=str(path), bin_dtype=dtype, seq_len=16))
  assert train.dtype == np.dtype(dtype)
  assert vocab == int(stream.max()) + 1
  want_train, want_val = _split(stream)
  np.testing.assert_array_equal(train, want_train)
  np.testing.assert_array_equal(val, want_val)


def test_load_text(tmp_path):
  text = ("hello, world\n" * 100).encode()
  path = tmp_path / "corpus.txt"
  path.write_bytes(text)
  train, val, vocab = data.load_tokens(DataConfig(path=str(path), seq_len=8, val_fraction=0.1))
  assert vocab == 256 and train.dtype == np.uint8
  assert bytes(train) + bytes(val) == text
  assert len(val) == int(len(text) * 0.1)


def test_load_errors(tmp_path):
  missing = str(tmp_path / "nope.bin")
  with pytest.raises(ConfigError, match="nope.bin") as e:
    data.load_tokens(DataConfig(path=missing))
  assert "\n" not in str(e.value)
  two_d = tmp_path / "two_d.npy"
  np.save(two_d, np.zeros((4, 100), np.int32))
  with pytest.raises(ConfigError, match="1-D"):
    data.load_tokens(DataConfig(path=str(two_d), seq_len=4))
  floats = tmp_path / "floats.npy"
  np.save(floats, np.zeros(1000, np.float32))
  with pytest.raises(ConfigError, match="integer"):
    data.load_tokens(DataConfig(path=str(floats), seq_len=4))
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"\x00" * 1001)
  with pytest.raises(ConfigError, match="multiple of 2"):
    data.load_tokens(DataConfig(path=str(odd), seq_len=4))
  with pytest.raises(ConfigError, match="bin_dtype"):
    data.load_tokens(DataConfig(path=str(odd), bin_dtype="int8", seq_len=4))
  short = tmp_path / "short.txt"
  short.write_bytes(b"x" * 100)
  with pytest.raises(ConfigError, match="100 tokens"):
    data.load_tokens(DataConfig(path=str(short), seq_len=64))
  with pytest.raises(ConfigError, match="val_fraction"):
    data.load_tokens(DataConfig(path=str(short), seq_len=4, val_fraction=0.0))


SEQ, BATCH = 4, 8
TOKENS = np.arange(SEQ * 37 + 1, dtype=np.uint16)  # 37 windows -> 4 batches per epoch


def _windows(rows):
  """Window index of each row (rows of TOKENS = arange start at window * SEQ)."""
  assert (rows == rows[:, :1] + np.arange(SEQ + 1)).all()
  assert (rows[:, 0] % SEQ == 0).all()
  return rows[:, 0] // SEQ


def test_loader_windows_and_epochs():
  loader = data.BatchLoader(TOKENS, SEQ, BATCH, seed=3)
  assert loader.num_windows == 37 and loader.batches_per_epoch == 4
  for epoch in range(3):
    seen = []
    for _ in range(loader.batches_per_epoch):
      rows = loader.next_local()
      assert rows.shape == (BATCH, SEQ + 1) and rows.dtype == np.int32
      seen.extend(_windows(rows).tolist())
    assert len(seen) == len(set(seen)) == 32  # each window at most once per epoch
    assert max(seen) < 37
    want = np.random.default_rng([3, epoch]).permutation(37)[:32]
    assert seen == want.tolist()
  assert loader.position == 12


def test_loader_deterministic_and_resumable():
  fresh = data.BatchLoader(TOKENS, SEQ, BATCH, seed=1)
  batches = [fresh.next_local() for _ in range(10)]
  again = data.BatchLoader(TOKENS, SEQ, BATCH, seed=1)
  for b in batches:
    np.testing.assert_array_equal(again.next_local(), b)
  for k in (0, 3, 4, 9):
    resumed = data.BatchLoader(TOKENS, SEQ, BATCH, seed=1, position=k)
    np.testing.assert_array_equal(resumed.next_local(), batches[k])
    assert resumed.position == k + 1
    np.testing.assert_array_equal(fresh.batch_at(k), batches[k])
  assert fresh.position == 10
  other = data.BatchLoader(TOKENS, SEQ, BATCH, seed=2)
  assert not np.array_equal(other.next_local(), batches[0])


def test_loader_processes_partition_global_batch():
  single = data.BatchLoader(TOKENS, SEQ, BATCH, seed=5)
  procs = [data.BatchLoader(TOKENS, SEQ, BATCH, seed=5, process_index=p, process_count=2)
           for p in range(2)]
  for _ in range(6):
    local = [p.next_local() for p in procs]
    assert all(x.shape == (BATCH // 2, SEQ + 1) for x in local)
    np.testing.assert_array_equal(np.concatenate(local), single.next_local())


def test_loader_errors():
  with pytest.raises(ConfigError, match="divisible"):
    data.BatchLoader(TOKENS, SEQ, BATCH, seed=0, process_index=0, process_count=3)
  with pytest.raises(ConfigError, match="process_index"):
    data.BatchLoader(TOKENS, SEQ, BATCH, seed=0, process_index=2, process_count=2)
  with pytest.raises(ConfigError, match="global_batch_size=64"):
    data.BatchLoader(TOKENS, SEQ, 64, seed=0)
  with pytest.raises(ConfigError, match="global_batch_size=0"):
    data.BatchLoader(TOKENS, SEQ, 0, seed=0)


def test_make_global_batch():
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  n = len(jax.devices())
  sharding = NamedSharding(jax.make_mesh((n,), ("b",)), P("b"))
  loader = data.BatchLoader(TOKENS, SEQ, n * max(1, 8 // n), seed=0)
  rows = loader.next_local()
  batch = data.make_global_batch(rows, sharding, loader.global_batch_size)
  assert batch.shape == rows.shape and batch.dtype == np.int32
  assert batch.sharding == sharding
  np.testing.assert_array_equal(np.asarray(batch), rows)
