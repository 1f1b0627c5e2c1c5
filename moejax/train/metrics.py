"""Host-side expert-load statistics and the per-run JSONL metrics file (numpy only)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from typing import IO

import numpy as np

from moejax.layout.flow import max_over_mean


def device_load(slot_counts_WxS: np.ndarray, expert_devices: int) -> np.ndarray:
  """Choices sent to each (data row, expert-axis device), flattened row-major.

  Sources are ordered (data, expert) row-major, so the sources of data row r are
  rows r*N .. r*N+N-1, and they only talk to the N devices of row r; device d of
  a row hosts slots d*C .. d*C+C-1.
  """
  slot_counts_WxS = np.asarray(slot_counts_WxS)
  sources, num_slots = slot_counts_WxS.shape
  rows = sources // expert_devices
  per_row_slot = slot_counts_WxS.reshape(rows, expert_devices, num_slots).sum(axis=1)  # [rows, S]
  return per_row_slot.reshape(rows, expert_devices, -1).sum(axis=2).reshape(-1)


def moe_layer_records(metrics: dict, expert_devices: int) -> list[dict]:
  """One JSON-ready record per MoE layer from a step's metrics (numpy arrays)."""
  records = []
  counts_LxWxE = np.asarray(metrics["counts_LxWxE"])
  dropped_LxW = np.asarray(metrics["dropped_LxW"])
  for layer, counts_WxE in enumerate(counts_LxWxE):
    load = device_load(metrics["slot_counts_LxWxS"][layer], expert_devices)
    total = int(counts_WxE.sum())
    records.append({
        "layer": layer,
        "expert_counts": counts_WxE.sum(axis=0).tolist(),
        "counts_by_source": counts_WxE.tolist(),
        "device_load": load.tolist(),
        "max_over_mean_load": max_over_mean(load),
        **_realised(metrics, layer),
        "dropped_fraction": float(dropped_LxW[layer].sum()) / max(total, 1),
        "balance_loss": float(metrics["balance_loss_L"][layer]),
        "z_loss": float(metrics["z_loss_L"][layer]),
    })
  return records


def _realised(metrics: dict, layer: int) -> dict:
  """The work each device did after capacity (absent from metrics of older runs)."""
  if "received_LxWxN" not in metrics:
    return {}
  received_WxN = np.asarray(metrics["received_LxWxN"][layer])
  computed_W = received_WxN.sum(axis=1)
  return {"realised_load": computed_W.tolist(),
          "realised_max_over_mean": max_over_mean(computed_W),
          "received_by_source": received_WxN.tolist(),
          "dropped_by_device": np.asarray(metrics["overflow_LxW"][layer]).tolist()}


def _step_of(line: str) -> float:
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return float("inf")   # a torn last line from a killed run is dropped


def replace_file(path: str, text: str) -> None:
  """Writes `text` to `path` whole or not at all (a temporary file, then a rename); the
  temporary file never outlives a failed write."""
  try:
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)
  finally:
    if os.path.exists(path + ".tmp"):
      os.unlink(path + ".tmp")


class JsonlWriter:
  """Appends one JSON object per line; a no-op on processes other than 0.

  On resume from step `start`, records of steps >= start (written after the checkpoint the run
  resumes from, and about to be redone) move to `<name>.redone.jsonl` beside the file, and a
  torn last line (a run killed in the middle of a write, or stopped by a full disk) is dropped,
  so that every step appears once and the records before `start` stay as they were. The file
  is rewritten into a new one that replaces it only when complete. `guard(what, path)`: a
  context manager around every write that turns a failed one into the caller's error (default:
  none).
  """

  def __init__(self, path: str, enabled: bool = True, start: int = 0, guard=None):
    self.path = path
    self._guard = guard or (lambda what, path: contextlib.nullcontext())
    self._file: IO[str] | None = None
    if enabled:
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
      if os.path.exists(path):
        with open(path) as f:
          lines = f.readlines()
        kept = [line for line in lines if _step_of(line) < start]
        redone = [line for line in lines if start <= _step_of(line) < float("inf")]
        if redone:   # appended: earlier resumes' redone records stay
          redone_path = os.path.splitext(path)[0] + ".redone.jsonl"
          before = ""
          if os.path.exists(redone_path):
            with open(redone_path) as f:
              before = f.read()
          with self._guard("the metrics of redone steps", redone_path + ".tmp"):
            replace_file(redone_path, before + "".join(
                line if line.endswith("\n") else line + "\n" for line in redone))
        with self._guard("the metrics kept on resume", path + ".tmp"):
          replace_file(path, "".join(kept))
      self._file = open(path, "a", buffering=1)

  def write(self, record: dict) -> None:
    if self._file is None:
      return
    try:
      with self._guard(f"the metrics of step {record.get('step')}", self.path):
        self._file.write(json.dumps(record) + "\n")
    except BaseException:
      self._abandon()
      raise

  def _abandon(self) -> None:
    """After a failed write: drop what Python still buffers (its flush would fail again);
    the torn line is repaired on resume."""
    f, self._file = self._file, None
    try:
      f.close()
    except OSError:
      pass

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


class TokenRate:
  """Tokens/s over the last `window` - 1 intervals between reads of step metrics. `reset()`
  after host work that is not training (eval, a save, a switch) keeps it out of the rate."""

  def __init__(self, tokens_per_step: int, window: int = 11):
    self.tokens_per_step = tokens_per_step
    self._reads: collections.deque = collections.deque(maxlen=window)

  def tick(self) -> float | None:
    """Marks a step's metrics read now; the rate so far (None until two reads)."""
    self._reads.append(time.perf_counter())
    span = self._reads[-1] - self._reads[0]
    return self.tokens_per_step * (len(self._reads) - 1) / span if span > 0 else None

  def reset(self) -> None:
    self._reads.clear()
