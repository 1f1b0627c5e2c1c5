"""Evaluate a placement on a count matrix: device loads, bytes sent, crossings."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moejax.layout import adaptive, host_layout as placement_lib


class Flow(NamedTuple):
  device_load_N: np.ndarray    # (token, k) rows each device computes
  sent_N: np.ndarray           # rows each device sends to other devices
  crossing: int                # rows whose expert runs off their source device


def flow(p: placement_lib.Placement, counts_WxE: np.ndarray,
         src_dev_W: np.ndarray) -> Flow:
  """Routes counts_WxE by `p.routing`; "adaptive" (fsep with `moe.fsep_shares='adaptive'`)
  sums each device's sources first, as the layer routes one source per device."""
  counts = np.rint(np.asarray(counts_WxE)).astype(np.int64)
  n = p.num_devices
  if p.routing == "adaptive":
    counts = placement_lib.device_counts(counts, src_dev_W, n).astype(np.int64)
    src_dev_W = np.arange(n)
    loads_NxS = adaptive.split_adaptive(p, counts)
    slot_load, sent_WxN = loads_NxS.sum(0), loads_NxS.reshape(n, n, -1).sum(-1)
  else:
    slot_load, sent_WxN = placement_lib.route(p, counts, src_dev_W)
  offdev_WxN = sent_WxN.copy()
  offdev_WxN[np.arange(len(src_dev_W)), src_dev_W] = 0
  sent_N = np.zeros(n, np.int64)
  np.add.at(sent_N, src_dev_W, offdev_WxN.sum(1))
  return Flow(placement_lib.device_load(p, slot_load), sent_N, int(offdev_WxN.sum()))


def max_over_mean(load_N: np.ndarray) -> float:
  mean = float(np.mean(load_N))
  return float(np.max(load_N)) / mean if mean > 0 else 1.0
