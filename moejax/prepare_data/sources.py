"""The input side of the data step: which files, read as a stream of bounded chunks."""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator

from moejax.config import ConfigError
from moejax.train.data import is_val_file

CHUNK_BYTES = 1 << 18   # a chunk ends at the last newline within this many bytes
MIN_CHUNKS = 64         # an input smaller than 64 chunks is cut into smaller ones to split


@dataclasses.dataclass(frozen=True)
class Chunk:
  """Up to CHUNK_BYTES of one file, cut after a newline; `first`: it starts the file."""
  path: str
  index: int
  data: bytes
  first: bool
  val: bool


def input_files(pattern: str, exclude: tuple[str, ...] = (), skip_dir: str | None = None
                ) -> list[str]:
  """Sorted regular files matching `pattern` (`**` recurses), minus those matching an
  `exclude` pattern or lying under `skip_dir` (the output directory)."""
  excluded: set[str] = set()
  for ex in exclude:
    excluded.update(os.path.abspath(p) for p in glob.glob(ex, recursive=True))
  skip = os.path.abspath(skip_dir) + os.sep if skip_dir else None
  files = sorted(p for p in glob.glob(pattern, recursive=True)
                 if os.path.isfile(p) and os.path.abspath(p) not in excluded
                 and not (skip and os.path.abspath(p).startswith(skip)))
  if not files:
    raise ConfigError(f"--input {pattern!r} matches no files (after --exclude); quote the "
                      "pattern so the shell leaves '**' to us, e.g. --input 'texts/**/*.txt'.")
  return files


def _pieces(f, chunk_bytes: int) -> Iterator[bytes]:
  """The file's bytes in pieces of at most chunk_bytes, each cut after its last newline
  (a line longer than chunk_bytes is cut where the piece is full)."""
  rest = b""
  while True:
    block = f.read(chunk_bytes - len(rest))
    data = rest + block
    if not block:
      if data:
        yield data
      return
    cut = data.rfind(b"\n") + 1 if len(data) >= chunk_bytes else len(data)
    cut = cut or len(data)
    yield data[:cut]
    rest = data[cut:]


def chunk_size(files: list[str], chunk_bytes: int | None = None) -> int:
  """`chunk_bytes`, or by default CHUNK_BYTES, made smaller for a small input so that it makes
  at least MIN_CHUNKS chunks to split (never below 4 KiB)."""
  if chunk_bytes is not None:
    return chunk_bytes
  total = sum(os.path.getsize(p) for p in files)
  return max(4096, min(CHUNK_BYTES, total // MIN_CHUNKS))


def _hashed(files: list[str], val_fraction: float, root: str, chunk_bytes: int
            ) -> Iterator[Chunk]:
  for path in files:
    rel = os.path.relpath(os.path.abspath(path), root).replace(os.sep, "/")
    try:
      with open(path, "rb") as f:
        for k, data in enumerate(_pieces(f, chunk_bytes)):
          yield Chunk(rel, k, data, k == 0, is_val_file(f"{rel}:{k}", val_fraction))
    except OSError as e:
      raise ConfigError(f"cannot read input file {path!r} ({e.strerror}); fix its permissions "
                        "or leave it out with --exclude.") from None


def stream_chunks(files: list[str], val_fraction: float, root: str | None = None,
                  chunk_bytes: int | None = None) -> Iterator[Chunk]:
  """Every file's chunks in order (of `chunk_size(files, chunk_bytes)` bytes at most). Chunk k
  of a file goes to validation iff `is_val_file(f"{relpath}:{k}", val_fraction)` (crc32, so
  the split is stable), which keeps a file of one chunk whole and still splits a single large
  file. If the hash gave one split nothing by the last chunk, the last chunk goes to it, so
  that an input of two chunks or more (one file of 8 KiB or more) always makes both splits."""
  root = root or os.path.commonpath([os.path.abspath(p) for p in files])
  if os.path.isfile(root):
    root = os.path.dirname(root)
  seen = {False: False, True: False}
  previous = None
  for chunk in _hashed(files, val_fraction, root, chunk_size(files, chunk_bytes)):
    if previous is not None:
      seen[previous.val] = True
      yield previous
    previous = chunk
  if previous is not None:
    if any(seen.values()) and not seen[not previous.val]:
      previous = dataclasses.replace(previous, val=not previous.val)
    yield previous
