"""SmartMoE placement: a permutation, exactly E/N experts per device.

Two candidates: improving swaps off the busiest device starting from the current
placement (few moves), and greedy longest-processing-time on the predicted
per-expert load (keep the expert's current device on ties) followed by the same
swaps. The reshuffle is preferred only when it beats the swaps-only candidate
by more than `min_gain`; the winner is adopted only if its predicted max device
load is lower than the current placement's by more than `min_gain` (relative),
otherwise the current placement is returned unchanged. Experts that stay on their device keep their
slot, so nothing is silently relabelled and migration moves only what moved.

Under pooled capacity (`moe.capacity = 'device'`, `pooled_capacity_factor` > 0) what costs is
not the busiest device's mean load but the choices each (source, device) buffer drops, step
by step: two pairings with the same mean peak can drop very differently once per-step
fluctuations are counted. Then every candidate is scored by the drops it would have had on
each recent step (`samples_stepsxWxE`), the best is improved by pair swaps on that score, and
`min_gain` applies to the predicted drops.
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
  pooled_capacity_factor: float = 0.0   # > 0: score by pooled drops at this factor (see doc)


def pooled_drops(samples_stepsxWxE: np.ndarray, dev_E: np.ndarray, n: int,
                 cap_stepsxW: np.ndarray) -> float:
  """Choices the (source, device) buffers of `cap_stepsxW` rows drop over the sampled steps."""
  load_stepsxWxN = samples_stepsxWxE @ np.eye(n)[dev_E]
  return float(np.maximum(load_stepsxWxN - cap_stepsxW[..., None], 0).sum())


def _swaps_for_drops(samples_stepsxWxE, dev_E, n, cap_stepsxW, max_iters):
  """Best pair swap (on pooled drops) until none lowers them."""
  dev_E = dev_E.copy()
  s_ExstepsxW = np.moveaxis(samples_stepsxWxE, -1, 0)
  for _ in range(max_iters):
    load_NxstepsxW = np.moveaxis(samples_stepsxWxE @ np.eye(n)[dev_E], -1, 0)
    drop_N = np.maximum(load_NxstepsxW - cap_stepsxW, 0).sum((1, 2))
    # Swap a <-> b: a's device loses a and gains b, b's device the reverse.
    delta_ExExstepsxW = s_ExstepsxW[None] - s_ExstepsxW[:, None]        # [a, b]: s_b - s_a
    at_a = np.maximum(load_NxstepsxW[dev_E][:, None] + delta_ExExstepsxW - cap_stepsxW,
                      0).sum((2, 3))
    at_b = np.maximum(load_NxstepsxW[dev_E][None, :] - delta_ExExstepsxW - cap_stepsxW,
                      0).sum((2, 3))
    gain_ExE = drop_N[dev_E][:, None] + drop_N[dev_E][None, :] - at_a - at_b
    gain_ExE[dev_E[:, None] == dev_E[None, :]] = 0
    a, b = np.unravel_index(np.argmax(gain_ExE), gain_ExE.shape)
    if gain_ExE[a, b] <= 1e-9:
      break
    dev_E[a], dev_E[b] = dev_E[b], dev_E[a]
  return dev_E


def place_permutation(pred_WxE: np.ndarray, current: placement_lib.Placement, *,
                      slots: int | None = None, src_dev_W: np.ndarray | None = None,
                      cost: CostModel | None = None, num_devices: int | None = None,
                      options: SmartMoEOptions = SmartMoEOptions(),
                      samples_stepsxWxE: np.ndarray | None = None) -> placement_lib.Placement:
  """A permutation of the experts, E/N per device, for the summed load (see the module doc);
  the shared keywords other than `current` (and `samples_stepsxWxE` under pooled capacity) are
  not needed."""
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
  static_dev_E = np.arange(num_experts) // c
  if options.pooled_capacity_factor > 0 and samples_stepsxWxE is not None:
    samples = np.asarray(samples_stepsxWxE, np.float64)
    # A source's buffer to each device holds cf x its balanced share of its choices.
    cap_stepsxW = np.ceil(options.pooled_capacity_factor * samples.sum(-1) / n)
    score = lambda d: pooled_drops(samples, d, n, cap_stepsxW)
    best = min((local, reshuffle, static_dev_E, cur_dev_E), key=score)
    dev_E = _swaps_for_drops(samples, best, n, cap_stepsxW, iters)
  else:
    score = peak
    dev_E = reshuffle if peak(reshuffle) < peak(local) * (1 - min_gain) else local
  if score(static_dev_E) < score(dev_E):
    dev_E = static_dev_E
  cur = score(cur_dev_E)
  # Keep the current layout unless the gain is worth it, but never keep one that is
  # predicted worse than static.
  keep = cur <= 0 or (cur - score(dev_E)) / cur <= min_gain
  if keep and cur <= score(static_dev_E):
    return current
  return placement_lib.one_copy(_to_slots(dev_E, current, c), n)
