"""Capacity arithmetic on the host: buffer rows, and the drops a layout would have.

The layer's two capacity modes (`moe.capacity`):
  'slot'    `cap` rows per (source, slot): a slot's overflow is dropped even when the other
            slots of its device have room, so a placement cannot change the drops.
  'device'  `cap` rows per (source, device), shared by the device's C slots: a device that
            holds hot and cold experts absorbs the hot one's overflow.
How many choices drop depends only on the per-buffer loads, not on which choices the drop
rule picks, so the planners and reports predict drops from counts alone.
"""

from __future__ import annotations

import math

import numpy as np

MODES = ("slot", "device")


def buffers_per_source(mode: str, num_devices: int, slots: int) -> int:
  return num_devices * slots if mode == "slot" else num_devices


def rows(mode: str, num_tokens: int, top_k: int, num_devices: int, slots: int,
         capacity_factor: float) -> int:
  """Rows per buffer: capacity_factor times the balanced share T * K / buffers, at least 1."""
  share = num_tokens * top_k / buffers_per_source(mode, num_devices, slots)
  return max(1, math.ceil(capacity_factor * share))


def ragged_rows(num_tokens: float, top_k: int, num_devices: int, factor: float) -> int:
  """The ragged dispatch's receive buffer per device, in rows: `factor` x the balanced share
  T*K, fixed whatever the load (0: N*T*K, the worst case, when every source sends every
  choice to this device)."""
  choices = num_tokens * top_k
  if factor <= 0:
    return num_devices * choices
  return max(1, min(num_devices * choices, math.ceil(factor * choices)))


def buffer_loads(mode: str, loads_WxS: np.ndarray, slots: int) -> np.ndarray:
  """[W, buffers]: choices each source routes into each buffer (slot loads summed per device
  under pooling)."""
  loads_WxS = np.asarray(loads_WxS, np.int64)
  if mode == "slot":
    return loads_WxS
  return loads_WxS.reshape(len(loads_WxS), -1, slots).sum(-1)


def dropped(mode: str, loads_WxS: np.ndarray, slots: int, cap: int) -> int:
  """Choices the layer drops when each source's buffers hold `cap` rows."""
  return int(np.maximum(buffer_loads(mode, loads_WxS, slots) - cap, 0).sum())


def computed_by_device(mode: str, loads_WxS: np.ndarray, slots: int, cap: int) -> np.ndarray:
  """[N]: rows each device computes after capacity (sources of one data row)."""
  kept = np.minimum(buffer_loads(mode, loads_WxS, slots), cap)
  if mode == "slot":
    kept = kept.reshape(len(kept), -1, slots).sum(-1)
  return kept.sum(0)


def smallest_factor(mode: str, loads_WxS: np.ndarray, slots: int, num_tokens: int,
                    top_k: int, max_drop_fraction: float) -> float:
  """Smallest capacity factor whose buffers drop at most `max_drop_fraction` of the choices.
  Drops fall as `cap` grows, so the smallest integer `cap` is found by bisection and the
  factor is the one `rows` maps to exactly that `cap`."""
  loads_WxS = np.asarray(loads_WxS, np.int64)
  allowed = math.floor(max_drop_fraction * loads_WxS.sum())
  lo, hi = 1, max(1, int(buffer_loads(mode, loads_WxS, slots).max()))
  while lo < hi:
    mid = (lo + hi) // 2
    if dropped(mode, loads_WxS, slots, mid) <= allowed:
      hi = mid
    else:
      lo = mid + 1
  num_devices = loads_WxS.shape[1] // slots
  share = num_tokens * top_k / buffers_per_source(mode, num_devices, slots)
  factor = lo / share
  while rows(mode, num_tokens, top_k, num_devices, slots, factor) < lo:
    factor = math.nextafter(factor, math.inf)
  return factor
