"""Evaluate a placement on a count matrix: device loads, bytes sent, crossings."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moejax.layout import placement as pl


class Flow(NamedTuple):
  device_load_N: np.ndarray    # (token, k) rows each device computes
  sent_N: np.ndarray           # rows each device sends to other devices
  crossing: int                # rows whose expert runs off their source device


def flow(p: pl.Placement, counts_SxE: np.ndarray, src_dev_S: np.ndarray) -> Flow:
  counts = np.rint(np.asarray(counts_SxE)).astype(np.int64)
  slot_load, sent_SxN = pl.route(p, counts, src_dev_S)
  n = p.num_devices
  offdev_SxN = sent_SxN.copy()
  offdev_SxN[np.arange(len(src_dev_S)), src_dev_S] = 0
  sent_N = np.zeros(n, np.int64)
  np.add.at(sent_N, src_dev_S, offdev_SxN.sum(1))
  return Flow(pl.device_load(p, slot_load), sent_N, int(offdev_SxN.sum()))


def max_over_mean(load_N: np.ndarray) -> float:
  mean = float(np.mean(load_N))
  return float(np.max(load_N)) / mean if mean > 0 else 1.0
