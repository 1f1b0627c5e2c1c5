"""The run-dir lock: one run at a time writes a run dir (JAX-free).

The lock is a small JSON file, `RUN_DIR/run.lock`, naming the holder's host, pid and start
time. It is created whole or not at all: the content goes into a private file first, which is
then hard-linked to the lock's name (link fails if the name exists, on local filesystems and
NFS alike). A lock whose holder is gone (same host, and the pid no longer runs the process that
took it) is taken over with a warning; a lock of another host cannot be checked from here, so
it is respected unless `train.force_unlock`. Only the holder (process 0 of a multi-process
run) takes the lock; the others follow its outcome.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time

import jax

from moejax.config import ConfigError
from moejax.runtime import distributed

log = logging.getLogger("moejax")

__all__ = ["LOCK_NAME", "Holder", "RunDirBusy", "RunDirLock"]

LOCK_NAME = "run.lock"


class RunDirBusy(ConfigError):
  """Another run holds the run dir: one line naming the holder and the fix."""


def _proc_stat(pid: int) -> tuple[str, int] | None:
  """(state, start time in clock ticks since boot) of a process from Linux /proc, None where
  unknown. With the pid, the start time names one process even after the pid is reused; state
  'Z' is a process that has exited and waits to be reaped."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])
  except (OSError, IndexError, ValueError):
    return None


def _process_start_ticks(pid: int) -> int | None:
  stat = _proc_stat(pid)
  return None if stat is None else stat[1]


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  started: str          # UTC, ISO 8601
  start_ticks: int | None = None

  @staticmethod
  def me() -> Holder:
    return Holder(socket.gethostname(), os.getpid(),
                  time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  _process_start_ticks(os.getpid()))

  def describe(self) -> str:
    return f"pid {self.pid} on host {self.host} (started {self.started})"

  def same_process(self, other: Holder) -> bool:
    return (self.host, self.pid, self.start_ticks) == (other.host, other.pid, other.start_ticks)

  def alive(self) -> bool:
    """Whether the holder still runs; only answerable on its own host (else True)."""
    if self.host != socket.gethostname():
      return True
    try:
      os.kill(self.pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass   # a process of another user has that pid
    stat = _proc_stat(self.pid)
    if stat is None:
      return True
    state, ticks = stat
    return state != "Z" and (self.start_ticks is None or ticks == self.start_ticks)


def _read(path: str) -> Holder | None:
  """The lock's holder; None if there is no lock. An unreadable lock (torn by a crash of an
  older writer, or edited) names no live process, so it reads as a dead holder here."""
  try:
    with open(path) as f:
      d = json.load(f)
    return Holder(str(d["host"]), int(d["pid"]), str(d["started"]), d.get("start_ticks"))
  except FileNotFoundError:
    return None
  except (OSError, ValueError, KeyError, TypeError):
    return Holder(socket.gethostname(), -1, "unknown")


class RunDirLock:
  """`acquire()` takes the run dir or raises `RunDirBusy`; `release()` removes the lock if it
  is still ours; `held()` checks that it is (someone may have forced it since)."""

  def __init__(self, run_dir: str, force: bool = False):
    self.run_dir = run_dir
    self.path = os.path.join(run_dir, LOCK_NAME)
    self.force = force
    self.me = Holder.me()
    self.acquired = False
    self.created_run_dir = False   # acquire made it: release removes it again if left empty
    self.warnings: list[str] = []

  def acquire(self) -> list[str]:
    """Takes the lock; returns warnings (a stale or forced lock taken over)."""
    try:
      self.created_run_dir = not os.path.isdir(self.run_dir)
      os.makedirs(self.run_dir, exist_ok=True)
      self._link_probe()
    except OSError as e:
      raise ConfigError(f"train.run_dir={self.run_dir!r} cannot be written ({e.strerror}); set "
                        "train.run_dir to a directory this user can write.") from None
    warnings = self.warnings
    for _ in range(3):   # another run may take or drop the lock between our steps
      if self._link():
        self.acquired = True
        return warnings
      holder = _read(self.path)
      if holder is None:
        continue
      if holder.same_process(self.me):
        raise RunDirBusy(f"train.run_dir={self.run_dir!r} is already held by this process; "
                         "close the other Trainer on it first.")
      if holder.alive() and not self.force:
        other_host = holder.host != self.me.host
        raise RunDirBusy(
            f"train.run_dir={self.run_dir!r} is in use by {holder.describe()}: lock file "
            f"{self.path}; wait for that run to end or stop it, or use another train.run_dir" +
            ("; if that run is gone (its host cannot be checked from here), set "
             "train.force_unlock = True" if other_host else "") + ".")
      why = "forced (train.force_unlock)" if holder.alive() else "its holder is gone"
      if self._take_over(holder):
        self.acquired = True
        warnings.append(f"took over the lock of {self.path} from {holder.describe()}: {why}")
        return warnings
    raise RunDirBusy(f"train.run_dir={self.run_dir!r}: could not take the lock file {self.path} "
                     "(other runs keep taking it); start one run per run dir.")

  def held(self) -> bool:
    holder = _read(self.path)
    return holder is not None and holder.same_process(self.me)

  def release(self) -> None:
    """Removes the lock if it is still ours, and the run dir if this lock made it and the run
    left nothing in it (a run stopped by a configuration or data error)."""
    if self.acquired and self.held():
      os.unlink(self.path)
      if self.created_run_dir:
        try:
          os.rmdir(self.run_dir)
        except OSError:
          pass   # not empty: the run wrote something
    self.acquired = False

  def _link_probe(self) -> None:
    """Writes and removes the private file `_link` starts from (an unwritable dir fails here)."""
    tmp = f"{self.path}.{self.me.host}.{self.me.pid}.tmp"
    with open(tmp, "w"):
      pass
    os.unlink(tmp)

  def _link(self) -> bool:
    """Creates the lock whole (content first, then an atomic link to its name)."""
    tmp = f"{self.path}.{self.me.host}.{self.me.pid}.tmp"
    with open(tmp, "w") as f:
      json.dump(dataclasses.asdict(self.me), f)
    try:
      os.link(tmp, self.path)
      return True
    except FileExistsError:
      return False
    except OSError:   # a filesystem without hard links: exclusive create, then the content
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
      except FileExistsError:
        return False
      with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(self.me), f)
      return True
    finally:
      os.unlink(tmp)

  def _take_over(self, stale: Holder) -> bool:
    """Moves the stale lock aside and takes a new one. If what was moved is not the lock read
    a moment ago (another run took it over first), it is put back and this attempt fails."""
    aside = f"{self.path}.{self.me.host}.{self.me.pid}.stale"
    try:
      os.rename(self.path, aside)
    except FileNotFoundError:
      return False
    moved = _read(aside)
    if moved is None or moved != stale:
      os.rename(aside, self.path)
      return False
    os.unlink(aside)
    return self._link()


def take_run_dir(cfg) -> RunDirLock:
  """Process 0 takes the run dir's lock (`moejax.train.lock`); every process stops with
  `RunDirBusy` when it could not. Call before any work."""
  lock = RunDirLock(cfg.train.run_dir, cfg.train.force_unlock)
  error = None
  if jax.process_index() == 0:
    try:
      for w in lock.acquire():
        log.warning("warning: %s", w)
    except RunDirBusy as e:
      error = e
  if not distributed.all_true(error is None):
    raise error or RunDirBusy(f"process 0 could not take train.run_dir={cfg.train.run_dir!r}; "
                              "its error line says why.")
  return lock
