"""Token data: the embedded corpus, token files, prepared token directories, and a
deterministic resumable batch loader.

Everything but `make_global_batch` is pure numpy, so it can be tested without devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
import zlib
from typing import TYPE_CHECKING

import numpy as np

from moejax.config import Config, ConfigError, DataConfig

if TYPE_CHECKING:
  import jax

SEPARATOR = b"\n\x00\n"  # written before every file of the embedded corpus
BYTE_VOCAB = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_BIN_DTYPES = ("uint16", "uint32")
# A prepared token directory (`python -m moejax.prepare_data`): the two splits and meta.json,
# written last, so a directory without it is not (yet) prepared.
META_FILE, TRAIN_BIN, VAL_BIN = "meta.json", "train.bin", "val.bin"


def _check_fraction(val_fraction: float) -> None:
  if not 0.0 < val_fraction < 1.0:
    raise ConfigError(f"data.val_fraction={val_fraction} must be in (0, 1); use e.g. 0.05.")


def is_val_file(rel_path: str, val_fraction: float) -> bool:
  """Stable file-level split: a file is validation iff crc32(path) % 10000 < fraction * 10000."""
  return zlib.crc32(rel_path.encode("utf-8")) % 10000 < val_fraction * 10000


def stdlib_sources(root: str | None = None) -> tuple[str, list[str]]:
  """(root, sorted posix paths relative to root) of the stdlib's non-empty .py files."""
  root = root or sysconfig.get_paths()["stdlib"]
  rel_paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    for name in filenames:
      full = os.path.join(dirpath, name)
      if name.endswith(".py") and os.path.isfile(full) and os.path.getsize(full) > 0:
        rel_paths.append(os.path.relpath(full, root).replace(os.sep, "/"))
  return root, sorted(rel_paths)


def embedded_corpus(max_bytes: int, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
  """Byte-level (train, val) uint8 tokens from the Python standard library's .py sources.

  Files are taken in sorted relative-path order, each preceded by SEPARATOR, and go wholly to
  train or to validation by `is_val_file`. Train is filled up to (1 - val_fraction) * max_bytes
  and validation up to val_fraction * max_bytes (the last file of each is truncated to fit), so
  both splits are non-empty whenever the stdlib has files of both kinds.
  """
  if max_bytes < 2:
    raise ConfigError(f"data.max_corpus_bytes={max_bytes} must be >= 2.")
  _check_fraction(val_fraction)
  root, rel_paths = stdlib_sources()
  if not rel_paths:
    raise ConfigError(
        f"no .py files found under the stdlib directory {root!r} for the embedded corpus; "
        "set data.path to a token or text file.")
  val_budget = max(1, int(max_bytes * val_fraction))
  budgets = {False: max_bytes - val_budget, True: val_budget}
  parts: dict[bool, list[bytes]] = {False: [], True: []}
  for rel in rel_paths:
    if budgets[False] == 0 and budgets[True] == 0:
      break
    split = is_val_file(rel, val_fraction)
    if budgets[split] == 0:
      continue
    try:
      with open(os.path.join(root, rel), "rb") as f:
        chunk = SEPARATOR + f.read()
    except OSError:
      continue
    chunk = chunk[:budgets[split]]
    parts[split].append(chunk)
    budgets[split] -= len(chunk)
  train, val = (np.frombuffer(b"".join(parts[s]), dtype=np.uint8) for s in (False, True))
  return train, val


def _read_stream(cfg: DataConfig) -> tuple[np.ndarray, bool]:
  """The whole token stream of cfg.path (1-D integer array) and whether it is byte-level text."""
  path = cfg.path
  if not os.path.isfile(path):
    raise ConfigError(
        f"data.path={path!r} does not exist; give a prepared token directory, a .bin/.npy "
        "token file or a text file, or leave data.path unset for the embedded corpus.")
  ext = os.path.splitext(path)[1].lower()
  if ext == ".npy":
    try:
      arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
      raise ConfigError(f"data.path={path!r} is not a readable .npy array ({e}).") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ConfigError(
          f"data.path={path!r} holds a {arr.ndim}-D {arr.dtype} array; a .npy token file must "
          "be one 1-D integer stream (e.g. uint16, uint32 or int32).")
    return arr, False
  if ext == ".bin":
    if cfg.bin_dtype not in _BIN_DTYPES:
      raise ConfigError(
          f"data.bin_dtype={cfg.bin_dtype!r} is not supported; use one of {_BIN_DTYPES}.")
    dtype = np.dtype(cfg.bin_dtype)
    size = os.path.getsize(path)
    if size % dtype.itemsize:
      raise ConfigError(
          f"data.path={path!r} has {size} bytes, not a multiple of {dtype.itemsize} for "
          f"data.bin_dtype={cfg.bin_dtype!r}; check data.bin_dtype.")
    if size == 0:
      return np.zeros((0,), dtype), False
    return np.memmap(path, dtype=dtype, mode="r"), False
  with open(path, "rb") as f:
    return np.frombuffer(f.read(), dtype=np.uint8), True


def bin_dtype_for(vocab_size: int) -> str:
  """The smallest unsigned dtype of a token file that holds ids below `vocab_size`."""
  return "uint16" if vocab_size <= 2**16 else "uint32"


def read_meta(directory: str) -> dict:
  """meta.json of a prepared token directory, checked against its .bin files."""
  path = os.path.join(directory, META_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f"data.path={directory!r} is a directory without {META_FILE}; prepare one "
                      "with `python -m moejax.prepare_data --input 'TEXT/**/*.txt' --out DIR`.")
  try:
    with open(path) as f:
      meta = json.load(f)
    vocab, dtype = int(meta["vocab_size"]), str(meta["dtype"])
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"{path} is not a moejax meta.json ({type(e).__name__}: {e}); prepare "
                      "the directory again with python -m moejax.prepare_data.") from None
  if dtype not in _BIN_DTYPES or vocab < 1 or vocab > np.iinfo(dtype).max + 1:
    raise ConfigError(f"{path} gives vocab_size={vocab} with dtype={dtype!r}; need dtype in "
                      f"{_BIN_DTYPES} holding every id below vocab_size.")
  for name, key in ((TRAIN_BIN, "train_tokens"), (VAL_BIN, "val_tokens")):
    size = os.path.getsize(os.path.join(directory, name)) \
        if os.path.isfile(os.path.join(directory, name)) else -1
    if key in meta and size != int(meta[key]) * np.dtype(dtype).itemsize:
      raise ConfigError(f"{os.path.join(directory, name)} holds {max(size, 0)} bytes, but "
                        f"{META_FILE} says {meta[key]} {dtype} tokens; prepare it again.")
  return meta


def resolve_vocab(cfg: Config, data_vocab: int) -> Config:
  """cfg with model.vocab_size = 0 ("the data's") replaced by `data_vocab`; a prepared
  directory's vocab_size must be matched exactly, any other data's ids must fit."""
  model_vocab = cfg.model.vocab_size
  if model_vocab == 0:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=data_vocab))
  # A run from another model's weights cannot change its vocabulary: the data must.
  retokenize = (f"prepare data.path with the tokenizer of train.init_from="
                f"{cfg.train.init_from!r} (its hf/tokenizer.json)")
  if cfg.data.path and os.path.isdir(cfg.data.path) and model_vocab != data_vocab:
    fix = retokenize if cfg.train.init_from else (
        f"set model.vocab_size = {data_vocab}, or 0 to take it from the data")
    raise ConfigError(f"model.vocab_size={model_vocab} but {cfg.data.path!r} was prepared with "
                      f"vocab_size={data_vocab} ({META_FILE}); {fix}.")
  if data_vocab > model_vocab:
    fix = retokenize if cfg.train.init_from else (
        f"set model.vocab_size >= {data_vocab} (0: the data's)")
    raise ConfigError(f"the data has token ids up to {data_vocab - 1} but model.vocab_size="
                      f"{model_vocab}; {fix}.")
  return cfg


def byte_corpus_mismatch(cfg: Config) -> str | None:
  """With data.path unset the data is the built-in byte corpus (256 ids). A model of another
  vocabulary whose weights come from train.init_from (a converted model) has nothing to learn
  from it: a ConfigError. A model from scratch does learn (its other ids never occur): the
  warning to give, naming both vocabularies. None when the two agree."""
  vocab = cfg.model.vocab_size
  if cfg.data.path is not None or vocab in (0, BYTE_VOCAB):
    return None
  if cfg.train.init_from:
    tokenizer = os.path.join(cfg.train.init_from, "hf", "tokenizer.json")
    if not os.path.isfile(tokenizer):
      tokenizer = "the model's tokenizer.json"
    raise ConfigError(f"data.path is unset, so the data is the built-in byte corpus (vocab_size="
                      f"{BYTE_VOCAB}), but model.vocab_size={vocab} is the vocabulary of the "
                      f"weights of train.init_from={cfg.train.init_from!r}; set data.path to "
                      "text prepared with its tokenizer (python -m moejax.prepare_data "
                      f"--tokenizer {tokenizer}).")
  return (f"data.path is unset: training on the built-in byte corpus (vocab_size={BYTE_VOCAB}) "
          f"with model.vocab_size={vocab}, so ids {BYTE_VOCAB}..{vocab - 1} never occur; set "
          "data.path to your prepared data, or model.vocab_size = 0 to take the corpus's")


def declared_vocab(cfg: DataConfig) -> int | None:
  """The vocab size the data names without being read (None: a token file's largest id)."""
  if cfg.path is None:
    return BYTE_VOCAB
  if os.path.isdir(cfg.path):
    return int(read_meta(cfg.path)["vocab_size"])
  ext = os.path.splitext(cfg.path)[1].lower()
  return None if ext in (".bin", ".npy") or not os.path.isfile(cfg.path) else BYTE_VOCAB


def _load_directory(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, int]:
  meta = read_meta(cfg.path)
  train, val = (np.memmap(os.path.join(cfg.path, name), dtype=meta["dtype"], mode="r")
                if os.path.getsize(os.path.join(cfg.path, name)) else np.zeros((0,), meta["dtype"])
                for name in (TRAIN_BIN, VAL_BIN))
  for name, part in (("train", train), ("validation", val)):
    if len(part) < cfg.seq_len + 1:
      raise ConfigError(f"{cfg.path!r} has {len(part)} {name} tokens, fewer than "
                        f"data.seq_len+1={cfg.seq_len + 1}; lower data.seq_len or prepare "
                        "more text (or a larger --val_fraction).")
  return train, val, int(meta["vocab_size"])


def load_tokens(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, int]:
  """(train, val, vocab) for cfg: a prepared directory's own splits and vocab_size; otherwise
  the smallest vocab holding the ids, and validation the last val_fraction of a file stream."""
  _check_fraction(cfg.val_fraction)
  need = cfg.seq_len + 1
  if cfg.path is not None and os.path.isdir(cfg.path):
    return _load_directory(cfg)
  if cfg.path is None:
    train, val = embedded_corpus(cfg.max_corpus_bytes, cfg.val_fraction)
    for name, part in (("train", train), ("validation", val)):
      if len(part) < need:
        raise ConfigError(
            f"the embedded corpus {name} split has {len(part)} tokens, fewer than "
            f"data.seq_len+1={need}; raise data.max_corpus_bytes or lower data.seq_len.")
    return train, val, BYTE_VOCAB
  stream, byte_level = _read_stream(cfg)
  n = len(stream)
  n_val = max(int(n * cfg.val_fraction), need)
  if n - n_val < need:
    raise ConfigError(
        f"data.path={cfg.path!r} has {n} tokens, too few for train and validation splits of "
        f"at least data.seq_len+1={need} tokens each; lower data.seq_len or use more data.")
  if byte_level:
    vocab = BYTE_VOCAB
  else:
    lo, hi = int(stream.min()), int(stream.max())
    if lo < 0 or hi >= 2**31 - 1:
      raise ConfigError(
          f"data.path={cfg.path!r} has token ids in [{lo}, {hi}]; ids must be in [0, 2**31-1).")
    vocab = hi + 1
  return stream[:n - n_val], stream[n - n_val:], vocab


class BatchLoader:
  """Deterministic, resumable batches of non-overlapping windows of seq_len + 1 tokens.

  Window i is tokens[i*seq_len : i*seq_len + seq_len + 1]. Epoch e visits the windows in the
  order `np.random.default_rng([seed, e]).permutation(num_windows)`, global_batch_size at a time,
  dropping the remainder. `position` counts the global batches consumed (save it in
  checkpoints); process p of P gets global rows [p*B/P, (p+1)*B/P) of each batch, or the
  rows [start, stop) given as `rows` (see `process_rows`). Only those rows are read.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1, position: int = 0,
               rows: tuple[int, int] | None = None):
    if tokens.ndim != 1:
      raise ConfigError(f"BatchLoader needs a 1-D token stream, got shape {tokens.shape}.")
    if seq_len < 1:
      raise ConfigError(f"data.seq_len={seq_len} must be >= 1.")
    if global_batch_size < 1:
      raise ConfigError(f"data.global_batch_size={global_batch_size} must be >= 1.")
    if process_count < 1 or not 0 <= process_index < process_count:
      raise ConfigError(
          f"process_index={process_index} must be in [0, process_count={process_count}).")
    if global_batch_size % process_count:
      raise ConfigError(
          f"data.global_batch_size={global_batch_size} is not divisible by the "
          f"{process_count} processes; use a multiple of {process_count}.")
    if position < 0:
      raise ConfigError(f"data position={position} must be >= 0.")
    self.tokens = tokens
    self.seq_len = seq_len
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.process_index = process_index
    self.process_count = process_count
    self.position = position
    self.local_batch_size = global_batch_size // process_count
    self.row_start = process_index * self.local_batch_size
    if rows is not None:
      if not 0 <= rows[0] < rows[1] <= global_batch_size:
        raise ConfigError(f"rows={rows} must be a non-empty range within the "
                          f"data.global_batch_size={global_batch_size} rows of a batch.")
      self.row_start, self.local_batch_size = rows[0], rows[1] - rows[0]
    self.num_windows = max(0, (len(tokens) - 1) // seq_len)
    if self.num_windows < global_batch_size:
      raise ConfigError(
          f"{len(tokens)} tokens make {self.num_windows} windows of data.seq_len+1={seq_len + 1}, "
          f"fewer than data.global_batch_size={global_batch_size}; use more data or lower "
          "data.seq_len / data.global_batch_size.")
    self.batches_per_epoch = self.num_windows // global_batch_size
    self._perm_epoch = -1
    self._perm = np.zeros((0,), np.int64)
    self._offsets = np.arange(seq_len + 1, dtype=np.int64)

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
      self._perm_epoch = epoch
    return self._perm

  def window_ids_at(self, position: int) -> np.ndarray:
    """Global window indices of this process's rows of global batch `position`."""
    epoch, step = divmod(position, self.batches_per_epoch)
    start = step * self.global_batch_size + self.row_start
    return self._permutation(epoch)[start:start + self.local_batch_size]

  def batch_at(self, position: int) -> np.ndarray:
    """This process's rows of global batch `position`: int32 [B/P, seq_len+1]; no state change."""
    starts = self.window_ids_at(position).astype(np.int64) * self.seq_len
    return np.asarray(self.tokens[starts[:, None] + self._offsets], dtype=np.int32)

  def next_local(self) -> np.ndarray:
    """This process's rows of the current global batch; then advance `position` by one."""
    rows = self.batch_at(self.position)
    self.position += 1
    return rows


def make_global_batch(local_rows: np.ndarray, sharding, global_batch_size: int) -> jax.Array:
  """Assemble every process's local rows into one global [B, L+1] array laid out by
  `sharding` (the global shape is given, never inferred)."""
  import jax

  return jax.make_array_from_process_local_data(
      sharding, local_rows, (global_batch_size,) + local_rows.shape[1:])


def process_rows(sharding, global_batch_size: int, row_len: int) -> tuple[int, int]:
  """[start, stop) of the global batch rows that this process's devices hold under `sharding`
  (what `make_global_batch` expects as its local rows)."""
  shape = (global_batch_size, row_len)
  rows: set[int] = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    rows.update(range(*index[0].indices(global_batch_size)))
  start, stop = min(rows), max(rows) + 1
  if len(rows) != stop - start:
    raise ConfigError(f"this process's devices hold batch rows {sorted(rows)}, not one "
                      "contiguous block; order the mesh so each process owns a block of the "
                      "data and expert axes.")
  return start, stop
