"""SmartMoE placement: a permutation, exactly E/N experts per device.

Two candidates: improving swaps off the busiest device starting from the current
placement (few moves), and greedy longest-processing-time on the predicted
per-expert load (keep the expert's current device on ties) followed by the same
swaps. The reshuffle is preferred only when it beats the swaps-only candidate
by more than `min_gain`; the winner is adopted only if its predicted max device
load is lower than the current placement's by more than `min_gain` (relative),
otherwise the current placement is returned unchanged. Experts that stay on their device keep their
slot, so nothing is silently relabelled and migration moves only what moved.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import ConfigError
from moejax.layout import placement as placement_lib
from moejax.placement.cost import CostModel


def _lpt(load_E: np.ndarray, cur_dev_E: np.ndarray, n: int, c: int) -> np.ndarray:
  dev_E = np.full(len(load_E), -1, np.int64)
  dev_load = np.zeros(n)
  free = np.full(n, c)
  for e in np.argsort(-load_E, kind="stable"):
    open_devs = np.flatnonzero(free > 0)
    least = dev_load[open_devs].min()
    ties = open_devs[dev_load[open_devs] <= least]
    d = cur_dev_E[e] if cur_dev_E[e] in ties else ties[0]
    dev_E[e] = d
    dev_load[d] += load_E[e]
    free[d] -= 1
  return dev_E


def _improve_by_swaps(load_E: np.ndarray, dev_E: np.ndarray, n: int,
                      max_iters: int) -> np.ndarray:
  dev_E = dev_E.copy()
  for _ in range(max_iters):
    dev_load = np.bincount(dev_E, weights=load_E, minlength=n)
    hot = int(np.argmax(dev_load))
    mine = np.flatnonzero(dev_E == hot)
    other = np.flatnonzero(dev_E != hot)
    if len(other) == 0:
      break
    delta = load_E[mine][:, None] - load_E[other][None, :]          # moved off hot, net
    new_pair_max = np.maximum(dev_load[hot] - delta, dev_load[dev_E[other]][None, :] + delta)
    i, j = np.unravel_index(np.argmin(new_pair_max), new_pair_max.shape)
    if new_pair_max[i, j] >= dev_load[hot] - 1e-9:
      break
    a, b = mine[i], other[j]
    dev_E[a], dev_E[b] = dev_E[b], hot
  return dev_E


def _to_slots(dev_E: np.ndarray, current: placement_lib.Placement, c: int) -> np.ndarray:
  """Experts keep their slot if they stay on their device; movers fill freed slots."""
  n = current.num_devices
  slot_expert = np.full(n * c, -1, np.int32)
  cur_se = current.slot_expert
  for s, e in enumerate(cur_se):
    if e >= 0 and dev_E[e] == s // c:
      slot_expert[s] = e
  for e in np.flatnonzero(~np.isin(np.arange(len(dev_E)), slot_expert)):
    d = dev_E[e]
    free = np.flatnonzero(slot_expert[d * c:(d + 1) * c] < 0)
    slot_expert[d * c + free[0]] = e
  return slot_expert


@dataclasses.dataclass(frozen=True)
class SmartMoEOptions:
  min_gain: float = 0.02                # relative drop of the predicted busiest device to move
  max_swap_iters: int | None = None     # improving swaps per candidate (None: 4 * E)


def place_permutation(pred_WxE: np.ndarray, current: placement_lib.Placement, *,
                      slots: int | None = None, src_dev_W: np.ndarray | None = None,
                      cost: CostModel | None = None, num_devices: int | None = None,
                      options: SmartMoEOptions = SmartMoEOptions()) -> placement_lib.Placement:
  """A permutation of the experts, E/N per device, for the summed load (see the module doc);
  the shared keywords other than `current` are not needed."""
  min_gain = options.min_gain
  load_E = np.asarray(pred_WxE, np.float64).sum(0)
  num_experts, n = len(load_E), current.num_devices
  if num_experts % n:
    raise ConfigError(f"smartmoe needs E={num_experts} divisible by N={n} devices.")
  c = num_experts // n
  if current.slots_per_device != c or not current.is_one_copy(num_experts):
    current = placement_lib.static(num_experts, n)
  cur_dev_E = np.empty(num_experts, np.int64)
  hosted = current.slot_expert >= 0
  cur_dev_E[current.slot_expert[hosted]] = current.device_of_slot[hosted]
  iters = options.max_swap_iters or 4 * num_experts
  peak = lambda d: np.bincount(d, weights=load_E, minlength=n).max()
  local = _improve_by_swaps(load_E, cur_dev_E, n, iters)
  reshuffle = _improve_by_swaps(load_E, _lpt(load_E, cur_dev_E, n, c), n, iters)
  dev_E = reshuffle if peak(reshuffle) < peak(local) * (1 - min_gain) else local
  static_dev_E = np.arange(num_experts) // c
  if peak(static_dev_E) < peak(dev_E):
    dev_E = static_dev_E
  cur_max = peak(cur_dev_E)
  # Keep the current layout unless the gain is worth it, but never keep one that is
  # predicted worse than static.
  keep = cur_max <= 0 or (cur_max - peak(dev_E)) / cur_max <= min_gain
  if keep and cur_max <= peak(static_dev_E):
    return current
  return placement_lib.one_copy(_to_slots(dev_E, current, c), n)
