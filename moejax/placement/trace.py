"""Routing-trace recording: an `.npz` with counts[steps, layers, sources, experts], top_k, step."""

from __future__ import annotations

import os
import zipfile

import numpy as np


class TraceRecorder:
  """Collects counts[layers, sources, experts] per finished step; writes atomically (a new
  file replaces the old one only when complete).

  On resume from step `start` an existing trace keeps only its steps < start, so the
  file always describes one consistent history. What a killed write leaves (the unfinished
  new file) is removed; a trace that does not read (a disk that lost its last write) is moved
  aside to `PATH.damaged` and `warning` says so.
  """

  def __init__(self, path: str, top_k: int, start: int = 0):
    self.path, self.top_k = path, top_k
    self.steps: list[int] = []
    self.counts: list[np.ndarray] = []
    self.warning: str | None = None
    if os.path.exists(self._tmp):
      os.unlink(self._tmp)
    if os.path.exists(path):
      try:
        with np.load(path) as old:
          keep = old["step"] < start
          self.steps = old["step"][keep].tolist()
          self.counts = list(old["counts"][keep])
      except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        os.replace(path, path + ".damaged")
        self.warning = (f"the routing trace {path} does not read ({type(e).__name__}); moved "
                        f"it to {path}.damaged and started a new one from step {start}")

  @property
  def _tmp(self) -> str:
    return self.path + ".tmp.npz"

  def add(self, step: int, counts_LxWxE: np.ndarray, expert_devices: int) -> None:
    """`counts_LxWxE` as the step returns it: sources in (data, expert) row-major order.
    Stored expert-major, so that trace source s ran on expert-axis device s*N // W, the
    mapping replay assumes."""
    c = np.asarray(counts_LxWxE, np.int32)
    layers, sources, experts = c.shape
    rows = sources // expert_devices
    c = c.reshape(layers, rows, expert_devices, experts).transpose(0, 2, 1, 3)
    self.steps.append(int(step))
    self.counts.append(c.reshape(layers, sources, experts))

  def write(self) -> None:
    if not self.counts:
      return
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    try:
      np.savez_compressed(self._tmp, counts=np.stack(self.counts), top_k=np.int32(self.top_k),
                          step=np.asarray(self.steps, np.int64))
      os.replace(self._tmp, self.path)
    finally:
      if os.path.exists(self._tmp):   # a failed write (a full disk) leaves the old file
        os.unlink(self._tmp)
