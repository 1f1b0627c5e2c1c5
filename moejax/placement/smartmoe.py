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
each recent step (`samples_stepsxWxE`), the best is improved by pair swaps on that score
(`_swaps_for_drops`: searched from the dropping devices, bounded in work, so E = 256 on N = 64
plans in tens of milliseconds), and `min_gain` applies to the predicted drops.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from moejax.config import ConfigError
from moejax.layout import host_layout as placement_lib
from moejax.placement.layer_cost import CostModel


def _lpt(load_E: np.ndarray, cur_dev_E: np.ndarray, n: int, c: int) -> np.ndarray:
  """Longest processing time first: each expert, heaviest first, to the least loaded device
  with a free slot (its current device among equals, else the lowest index), from a heap of
  (load, device) with stale entries skipped: log N per expert."""
  dev_E = np.full(len(load_E), -1, np.int64)
  dev_load, free = [0.0] * n, [c] * n
  heap = [(0.0, d) for d in range(n)]
  for e in np.argsort(-load_E, kind="stable"):
    while heap[0][0] != dev_load[heap[0][1]] or free[heap[0][1]] == 0:
      heapq.heappop(heap)
    least, d = heap[0]
    cur = int(cur_dev_E[e])
    if free[cur] > 0 and dev_load[cur] <= least:
      d = cur
    dev_E[e] = d
    dev_load[d] += float(load_E[e])
    free[d] -= 1
    if free[d]:
      heapq.heappush(heap, (dev_load[d], d))
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
  """Experts keep their slot if they stay on their device; movers fill freed slots (on each
  device in expert order, lowest slot first)."""
  cur_se = current.slot_expert
  stay = (cur_se >= 0) & (dev_E[np.maximum(cur_se, 0)] == np.arange(len(cur_se)) // c)
  slot_expert = np.where(stay, cur_se, -1).astype(np.int32)
  placed = np.zeros(len(dev_E), bool)
  placed[cur_se[stay]] = True
  movers = np.flatnonzero(~placed)
  slot_expert[slot_expert < 0] = movers[np.argsort(dev_E[movers], kind="stable")]
  return slot_expert


@dataclasses.dataclass(frozen=True)
class SmartMoEOptions:
  min_gain: float = 0.02                # relative drop of the predicted busiest device to move
  max_swap_iters: int | None = None     # improving swaps per candidate (None: 4 * E)
  pooled_capacity_factor: float = 0.0   # > 0: score by pooled drops at this factor (see doc)


def pooled_drops(samples_stepsxWxE: np.ndarray, dev_E: np.ndarray, n: int,
                 cap_stepsxW: np.ndarray) -> float:
  """Choices the (source, device) buffers of `cap_stepsxW` rows drop over the sampled steps."""
  return _Drops(samples_stepsxWxE, n, cap_stepsxW).of(np.asarray(dev_E))


# (pair, sampled row) elements of one device's first search: at E = 256 on N = 64 with a
# window of 10 steps (640 rows per expert), its 4 experts against those of its 12 roomiest
# partner devices. All searches and updates of one decision sum at most _SEARCH_ROWS, each
# counted at least _SEARCH_FLOOR (the fixed cost of its numpy calls).
_PAIR_ROWS = 2**17
_SIDE = 8               # the most experts of a dropping device a search swaps out
_SEARCH_ROWS = 2**22
_SEARCH_FLOOR = 2**14
_FULL_ROWS = 2**22      # (pair, row) elements of a whole E x E scan that is kept and updated


def _swaps_for_drops(samples_stepsxWxE, dev_E, n, cap_stepsxW, max_iters):
  """Pair swaps that lower the pooled drops, off the dropping devices, until none is found.

  Swapping a (on device A) with b (on B) changes the drops only on A and B, and lowers them
  only if A or B drops now. So the search goes from the dropping device that drops most and
  has a gaining swap: the exact gain (both devices, every sampled row) of swapping each of its
  experts with each expert of its partner devices, the devices with the most room in the rows
  where it overflows; it takes that device's best swap (where every pair fits, the best swap
  of every dropping device: the full scan's pick up to ties). A device's gains are kept and,
  after a swap elsewhere, only the columns of the two changed devices' experts are summed again
  (2C columns, not E). Where a whole E x E scan fits `_FULL_ROWS` (E = 64 on N = 8 with a 10-step
  window) it is kept instead, every swap the full scan's best pair. Where one device's search fits
  `_PAIR_ROWS` every other device is a partner, so the result is a local optimum of the full E x E
  pair scan; above it a search keeps to the device's `_SIDE` busiest experts and its roomiest
  partners, and all searches stop after `_SEARCH_ROWS`, so a decision costs O(`_SEARCH_ROWS`), not
  O(E^2 x rows) per swap. At E = 256 the swaps past the first dozens lower the window's drops and
  not the next steps' (docs/decisions/0095), so the bound costs the program nothing."""
  return _Drops(samples_stepsxWxE, n, cap_stepsxW).swaps(dev_E, max_iters)


class _Drops:
  """The sampled loads expert-major ([E, rows], rows = steps x sources) and the buffers' rows."""

  def __init__(self, samples_stepsxWxE, n, cap_stepsxW):
    samples = np.asarray(samples_stepsxWxE, np.float64)
    self.s_ExK = np.ascontiguousarray(np.moveaxis(samples, -1, 0).reshape(samples.shape[-1], -1))
    self.cap_K = np.asarray(cap_stepsxW, np.float64).ravel()
    self.n = n

  def over(self, dev_E):
    """[N, rows]: each device's load over its buffer's rows (< 0: room); segment sums over the
    experts sorted by device."""
    order = np.argsort(dev_E, kind="stable")
    starts = np.searchsorted(dev_E[order], np.arange(self.n))
    over_NxK = np.zeros((self.n, len(self.cap_K)))
    held = np.flatnonzero(np.bincount(dev_E, minlength=self.n) > 0)
    over_NxK[held] = np.add.reduceat(self.s_ExK[order], starts[held], 0)
    return over_NxK - self.cap_K

  def of(self, dev_E):
    return float(np.maximum(self.over(dev_E), 0).sum())

  def swaps(self, dev_E, max_iters):
    s_ExK, n = self.s_ExK, self.n
    num_experts, rows = s_ExK.shape
    c = num_experts // n
    if c == 1:   # one expert per device: a swap only relabels two devices' buffers
      return np.asarray(dev_E).copy()
    if num_experts * num_experts * rows <= _FULL_ROWS:
      return self._full_scan(np.asarray(dev_E).copy(), max_iters)
    self.dev_E = dev_E = np.asarray(dev_E).copy()
    self.over_NxK = self.over(dev_E)
    self.drop_N = np.maximum(self.over_NxK, 0).sum(1)
    exact = c * c * (n - 1) * rows <= _PAIR_ROWS
    self.side = c if exact else min(c, _SIDE)
    self.devices = n - 1 if exact else max(1, min(n - 1, _PAIR_ROWS // (rows * self.side * c)))
    self.gains = {}        # device -> (its experts searched, [side, E] gains, -inf: not tried)
    self.budget = _SEARCH_ROWS
    for _ in range(max_iters):
      found, best = None, 1e-9
      for hot in np.argsort(-self.drop_N, kind="stable"):
        if self.drop_N[hot] <= 0 or self.budget <= 0:
          break
        if hot not in self.gains:
          self._search(hot)
        mine, gain = self.gains[hot]
        i, j = np.unravel_index(np.argmax(gain), gain.shape)
        if gain[i, j] > best:
          found, best = (mine[i], j), gain[i, j]
          if not exact:    # the first dropping device with a gain; exact: the best of all
            break
      if found is None:
        break
      self._swap(*found)
    return dev_E

  def _full_scan(self, dev_E, max_iters):
    """Small E: h(x, y) = the drops x's device saves with y in place of x, for every pair,
    a row summed again only when x's device changes; each swap is the pair with the largest
    h(a, b) + h(b, a), the first in row-major order."""
    s_ExK, over_NxK = self.s_ExK, self.over(dev_E)

    def h_rows(xs):
      over_xsxK = over_NxK[dev_E[xs]]
      after = np.maximum((over_xsxK - s_ExK[xs])[:, None] + s_ExK[None], 0).sum(-1)
      return np.maximum(over_xsxK, 0).sum(1)[:, None] - after

    h_ExE = h_rows(np.arange(len(dev_E)))
    for _ in range(max_iters):
      gain_ExE = np.where(dev_E[:, None] != dev_E[None, :], h_ExE + h_ExE.T, -np.inf)
      a, b = np.unravel_index(np.argmax(gain_ExE), gain_ExE.shape)
      if gain_ExE[a, b] <= 1e-9:
        break
      da, db = dev_E[a], dev_E[b]
      delta = s_ExK[b] - s_ExK[a]
      over_NxK[da] += delta
      over_NxK[db] -= delta
      dev_E[a], dev_E[b] = db, da
      changed = np.flatnonzero((dev_E == da) | (dev_E == db))
      h_ExE[changed] = h_rows(changed)
    return dev_E

  def _pay(self, elements):
    self.budget -= max(elements, _SEARCH_FLOOR)

  def _search(self, hot):
    s_ExK, dev_E, over_NxK = self.s_ExK, self.dev_E, self.over_NxK
    hot_K = over_NxK[hot] > 0
    mine = np.flatnonzero(dev_E == hot)
    if self.side < len(mine):   # the experts that fill its overflowing rows most
      mine = mine[np.argsort(-s_ExK[mine][:, hot_K].sum(1), kind="stable")[:self.side]]
    room_N = np.maximum(-over_NxK[:, hot_K], 0).sum(1)
    room_N[hot] = -np.inf
    partners = np.argsort(-room_N, kind="stable")[:self.devices]
    gain = np.full((len(mine), len(dev_E)), -np.inf)
    self.gains[hot] = mine, gain
    self._columns(hot, np.flatnonzero(np.isin(dev_E, partners)))

  def _columns(self, hot, others):
    """Sums the gains of swapping `hot`'s searched experts with `others` (on other devices)."""
    mine, gain = self.gains[hot]
    s_ExK, over_NxK, drop_N = self.s_ExK, self.over_NxK, self.drop_N
    s_mine, s_other = s_ExK[mine], s_ExK[others]
    over_K = over_NxK[hot]
    # Rows where no pair can overflow after the swap add nothing to either side: skip them.
    at_hot = over_K - s_mine.min(0) + s_other.max(0) > 0
    after_hot = np.maximum((over_K[at_hot] - s_mine[:, at_hot])[:, None] +
                           s_other[None, :, at_hot], 0).sum(-1)
    base_other = over_NxK[self.dev_E[others]] - s_other
    at_other = base_other.max(0) + s_mine.max(0) > 0
    after_other = np.maximum(base_other[None][..., at_other] + s_mine[:, None, at_other],
                             0).sum(-1)
    gain[:, others] = (drop_N[hot] + drop_N[self.dev_E[others]][None] - after_hot -
                       after_other)
    self._pay(len(mine) * len(others) * (int(at_hot.sum()) + int(at_other.sum())))

  def _swap(self, a, b):
    dev_E, over_NxK = self.dev_E, self.over_NxK
    da, db = dev_E[a], dev_E[b]
    delta = self.s_ExK[b] - self.s_ExK[a]
    over_NxK[da] += delta
    over_NxK[db] -= delta
    self.drop_N[[da, db]] = np.maximum(over_NxK[[da, db]], 0).sum(1)
    dev_E[a], dev_E[b] = db, da
    self.gains.pop(da, None)
    self.gains.pop(db, None)
    moved = np.flatnonzero((dev_E == da) | (dev_E == db))
    for hot, (_, gain) in list(self.gains.items()):
      if self.drop_N[hot] <= 0:
        del self.gains[hot]
        continue
      if np.isfinite(gain[0, [a, b]]).any():   # its search had tried a changed device
        self._columns(hot, moved)


def place_permutation(pred_WxE: np.ndarray, current: placement_lib.Placement, *,
                      slots: int | None = None, src_dev_W: np.ndarray | None = None,
                      cost: CostModel | None = None, num_devices: int | None = None,
                      options: SmartMoEOptions = SmartMoEOptions(),
                      samples_stepsxWxE: np.ndarray | None = None,
                      cap_stepsxW: np.ndarray | None = None) -> placement_lib.Placement:
  """A permutation of the experts, E/N per device, for the summed load (see the module doc);
  the shared keywords other than `current` (and `samples_stepsxWxE` under pooled capacity) are
  not needed. `cap_stepsxW`: the pooled buffers' rows per (step, source) (None: the factor's
  share of the samples' choices; a planner of some of the experts passes the whole layer's)."""
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
    if cap_stepsxW is None:
      cap_stepsxW = np.ceil(options.pooled_capacity_factor * samples.sum(-1) / n)
    drops = _Drops(samples, n, cap_stepsxW)
    score = drops.of
    best = min((local, reshuffle, static_dev_E, cur_dev_E), key=score)
    dev_E = drops.swaps(best, iters)
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
