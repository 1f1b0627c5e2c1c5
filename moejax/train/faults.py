"""Faults the run stops for (host-side, JAX-free): steps with a non-finite loss or gradient
are skipped by the train step, and this counts them and stops the run after too many in a row;
a write that fails (a full disk, a quota, a read-only mount) stops it at once, naming the path
and the space it needs."""

from __future__ import annotations

import errno
import logging
import os
import shutil

# What a failed write looks like where it does not arrive as an OSError (tensorstore, under
# orbax's async save, reports errno text inside other exception types).
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)
_DISK_TEXTS = tuple(os.strerror(e) for e in _DISK_ERRNOS)


class NonFiniteError(RuntimeError):
  """Too many consecutive non-finite steps; the message is one line with what to do."""


class NonFiniteGuard:
  """Counts skipped steps (saved in checkpoints, so a resumed run stops where it would have)."""

  def __init__(self, max_consecutive: int):
    self.max_consecutive = max_consecutive
    self.consecutive = 0
    self.total = 0

  def observe(self, step: int, skipped: bool) -> bool:
    """Records one finished step; True when `max_consecutive` steps in a row were skipped."""
    if not skipped:
      self.consecutive = 0
      return False
    self.consecutive += 1
    self.total += 1
    return self.consecutive >= self.max_consecutive

  def error(self, step: int, last_checkpoint: str) -> NonFiniteError:
    first = step - self.consecutive + 1
    return NonFiniteError(
        f"steps {first}..{step}: {self.consecutive} consecutive steps had a non-finite loss or "
        f"gradient and were skipped (train.max_consecutive_nonfinite={self.max_consecutive}); "
        f"stopped without saving, the last good checkpoint is {last_checkpoint}; lower "
        "optim.learning_rate or check the data, then re-run the same command.")

  def state_dict(self) -> dict:
    return {"consecutive": self.consecutive, "total": self.total}

  def load_state_dict(self, d: dict) -> None:
    self.consecutive = int(d.get("consecutive", 0))
    self.total = int(d.get("total", 0))


class WriteError(RuntimeError):
  """A write under the run dir (or the trace path) failed; one line naming the path, the free
  space and what to do. Nothing written before is touched."""


def disk_error(e: BaseException) -> OSError | str | None:
  """The OSError behind `e` (searched through its causes), or the errno text its message
  carries, or None when `e` is not a failed write."""
  seen = 0
  while e is not None and seen < 8:
    if isinstance(e, OSError):
      return e
    for text in _DISK_TEXTS:
      if text in str(e):
        return text
    e, seen = e.__cause__ or e.__context__, seen + 1
  return None


def free_bytes(path: str) -> int | None:
  """Free bytes on the filesystem holding `path` (its nearest existing parent)."""
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path).free
  except OSError:
    return None


def _mib(n: int | None) -> str:
  return "unknown" if n is None else f"{n / 2**20:.1f} MiB"


def write_error(cause: OSError | str, what: str, path: str, needed: int,
                resume_from: str) -> WriteError:
  """`what` (e.g. "checkpoint step 20") could not be written to `path`."""
  reason = cause if isinstance(cause, str) else (cause.strerror or str(cause))
  return WriteError(
      f"could not write {what} to {path}: {reason} ({_mib(free_bytes(path))} free there, it "
      f"needs about {_mib(needed)}); nothing saved before is touched: free at least "
      f"{_mib(needed)} there and re-run the same command to resume from {resume_from}.")


class DiskErrorNoise(logging.Filter):
  """Drops the log records that repeat a failed write's error: orbax's background threads log
  one traceback per array they could not write. The run reports it once, as a `WriteError`."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if exc is not None and disk_error(exc) is not None:
      return False
    text = record.getMessage()
    return not any(t in text for t in _DISK_TEXTS)


class RecoveredNoise(logging.Filter):
  """Drops orbax's reports of damage the run recovers from by itself: a checkpoint's
  `_CHECKPOINT_METADATA` file that does not parse (a kill during its write) is logged as an
  error on every read, though the step's arrays and meta, which the resume reads and verifies
  by their digest, are whole. A step that really is damaged gets the trainer's own warning."""

  TEXTS = ("Failed to json parse",)

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return not any(t in text for t in self.TEXTS)
