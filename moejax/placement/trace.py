"""Routing-trace recording: an `.npz` with counts[steps, layers, sources, experts], top_k, step."""

from __future__ import annotations

import os

import numpy as np


class TraceRecorder:
  """Collects counts[layers, sources, experts] per finished step; writes atomically.

  On resume from step `start` an existing trace keeps only its steps < start, so the
  file always describes one consistent history.
  """

  def __init__(self, path: str, top_k: int, start: int = 0):
    self.path, self.top_k = path, top_k
    self.steps: list[int] = []
    self.counts: list[np.ndarray] = []
    if os.path.exists(path):
      with np.load(path) as old:
        keep = old["step"] < start
        self.steps = old["step"][keep].tolist()
        self.counts = list(old["counts"][keep])

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
    tmp = self.path + ".tmp.npz"
    np.savez_compressed(tmp, counts=np.stack(self.counts), top_k=np.int32(self.top_k),
                        step=np.asarray(self.steps, np.int64))
    os.replace(tmp, self.path)
