"""Per-source token shares: keep a device's own tokens on its own replica first (numpy only).

The fsep planner fixes each replica's quota Q (its share of the expert's predicted load) so
that devices are level. Which source fills a quota does not change any device's load, so the
planner lets each device fill its own replicas first: device d keeps up to min(own, Q) of its
own predicted tokens for expert e on its replica of e. The kept fraction is the slot's `local`
share; the quotas left are filled by every source's remaining tokens split by one set of
shares per expert, (Q - kept) / sum(Q - kept), so each replica still serves Q.

Under the dense dispatch a kept row still occupies the (source, own device) buffer, and one
buffer size serves every pair: keeping everything piles a hot expert's rows onto that pair and
raises the capacity factor the program needs. So with a capacity mode given, what a device
keeps is scaled down until its own pair holds no more than the larger of the pair's rows
without locality and the balanced share (T*K / buffers), which the program sizes anyway.
"""

from __future__ import annotations

import numpy as np

from moejax.layout.host_layout import SHARE_PARTS
from moejax.placement.fsep.score import own_counts

BUDGET_ROUNDS = 4     # fixed-point steps: the shares of the rest move with what is kept


def keep_local(grid: np.ndarray, share: np.ndarray, dev_NxE: np.ndarray, load_E: np.ndarray,
               coarse_candsxE: np.ndarray | None = None, capacity: str | None = None,
               slots: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(kept [cands, N, rounds], remote [cands, N, rounds], rest [cands, E]) for the replicas
  grid[cands, N, rounds] with shares share[cands, N, rounds] on device counts dev_NxE: the
  fraction of its own tokens each replica keeps (1 where the device predicts none, so
  unexpected tokens stay home), the shares of the rest per expert (the plain shares where
  nothing is left), and each expert's predicted tokens left to split. Experts marked in
  `coarse_candsxE` (see counts.snap_counts: their shares are whole, even router parts) keep
  nothing back: the rest's shares would no longer be even, and one part of a hot expert on
  many devices is a few percent of a device's load, so rounding them would unlevel the
  devices.

  `capacity` ('slot' or 'device', the dense dispatch's mode; None: dropless, no buffer to
  keep) bounds the rows a device sends itself per buffer (module doc); `slots`: slots per
  device C, the buffers per source under 'slot' being N*C."""
  k, n, _ = grid.shape
  num_experts = len(load_E)
  quota = share * load_E.take(grid)
  own = own_counts(grid, dev_NxE)
  keep0 = np.minimum(own, quota)
  if coarse_candsxE is not None and coarse_candsxE.any():
    coarse = np.atleast_2d(coarse_candsxE).ravel().take(grid + (np.arange(k) * num_experts)
                                                    [:, None, None])
    keep0 = np.where(coarse, 0.0, keep0)
  gflat = grid + (np.arange(k) * num_experts)[:, None, None]
  keep = keep0
  if capacity is not None:
    keep = keep0 * _budget_scale(keep0, quota, own, share, gflat, dev_NxE, capacity,
                                 slots or grid.shape[2], k * num_experts)
  kept = np.where(own > 0, keep / np.maximum(own, 1e-300), 1.0)
  if coarse_candsxE is not None and coarse_candsxE.any():
    kept = np.where(coarse, 0.0, kept)
  left = quota - keep
  rest, remote = _rest_shares(left, gflat, share, k * num_experts)
  return kept, remote, rest.reshape(k, num_experts)


def _rest_shares(left, gflat, share, groups):
  """Each expert's tokens left to split [groups] and the shares of them per replica."""
  rest = np.bincount(gflat.ravel(), weights=left.ravel(), minlength=groups)
  rest_g = rest.take(gflat)
  return rest, np.where(rest_g > 1e-9, left / np.maximum(rest_g, 1e-300), share)


def _budget_scale(keep0, quota, own, share, gflat, dev_NxE, capacity, slots, groups):
  """The factor in [0, 1] on what each buffer of a device keeps ([cands, N, 1] pooled per device,
  [cands, N, rounds] per slot) that holds its own pair's rows within the budget (module doc).
  The pair's rows are kept + (own - kept) x remote, remote depending on every device's keep:
  solved for the factor with remote held, then remote updated, BUDGET_ROUNDS times."""
  n = dev_NxE.shape[0]
  pooled = capacity == "device"
  total_N = np.einsum("ne->n", dev_NxE)
  balanced = total_N / (n if pooled else n * slots)

  def per_buffer(x):
    return x.sum(-1, keepdims=True) if pooled else x

  budget = np.maximum(per_buffer(own * share), balanced[None, :, None])
  scale = np.ones_like(per_buffer(keep0))
  for _ in range(BUDGET_ROUNDS):
    _, remote = _rest_shares(quota - keep0 * scale, gflat, share, groups)
    fixed = per_buffer(own * remote)                   # rows sent home whatever is kept
    gain = per_buffer(keep0 * (1.0 - remote))          # extra rows per unit of the factor
    scale = np.where(gain > 1e-12, np.clip((budget - fixed) / np.maximum(gain, 1e-300), 0, 1),
                     1.0)
  return scale


def local_parts(kept: np.ndarray) -> np.ndarray:
  """Kept fractions rounded down to whole parts of SHARE_PARTS (what the router applies):
  rounding down sends the few leftover tokens through the split, never over a quota."""
  return np.floor(kept * SHARE_PARTS + 1e-9) / SHARE_PARTS
