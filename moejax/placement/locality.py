"""Per-source token shares: keep a device's own tokens on its own replica first (numpy only).

The fsep planner fixes each replica's quota Q (its share of the expert's predicted load) so
that devices are level. Which source fills a quota does not change any device's load, so the
planner lets each device fill its own replicas first: device d keeps
  k = min(own, Q, cap)
of its own predicted tokens for expert e on its replica of e (own: d's predicted count of e;
cap: the dense dispatch's rows per (source, slot), when the planner knows the capacity
factor, so kept rows do not overflow the pair's buffer). The kept fraction k / own is the
slot's `local` share; the quotas left, Q - k, are filled by every source's remaining tokens
split by one set of shares per expert, (Q - k) / sum(Q - k). Each replica then still serves Q
on the predicted counts, and the rows that stay home are the most any routing with these
quotas keeps: sum over replicas of min(own, Q).

This is the transport problem's greedy answer with a compact form: one kept fraction per slot
([N*C]) and one share per replica, not a [source, expert, replica] table.
"""

from __future__ import annotations

import numpy as np

from moejax.layout.placement import SHARE_PARTS
from moejax.placement.fsep_score import own_counts


def keep_local(grid: np.ndarray, share: np.ndarray, dev_NxE: np.ndarray, load_E: np.ndarray,
               cap_N: np.ndarray | None = None, coarse_candsxE: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(kept [cands, N, rounds], remote [cands, N, rounds], rest [cands, E]) for the replicas
  grid[cands, N, rounds] with shares share[cands, N, rounds] on device counts dev_NxE: the fraction
  of its own tokens each replica keeps (1 where the device predicts none, so unexpected tokens stay
  home), the shares of the rest per expert (the plain shares where nothing is left), and each
  expert's predicted tokens left to split. Experts marked in `coarse_candsxE` (see fsep.snap_counts:
  their shares are whole, even router parts) keep nothing back: the rest's shares would no longer be
  even, and one part of a hot expert on many devices is a few percent of a device's load, so
  rounding them would unlevel the devices."""
  k = grid.shape[0]
  num_experts = len(load_E)
  quota = share * load_E.take(grid)
  own = own_counts(grid, dev_NxE)
  keep = np.minimum(own, quota)
  if cap_N is not None:
    keep = np.minimum(keep, cap_N[None, :, None])
  gflat = grid + (np.arange(k) * num_experts)[:, None, None]
  kept = np.where(own > 0, keep / np.maximum(own, 1e-300), 1.0)
  if coarse_candsxE is not None and coarse_candsxE.any():
    coarse = np.atleast_2d(coarse_candsxE).ravel().take(gflat)
    keep, kept = np.where(coarse, 0.0, keep), np.where(coarse, 0.0, kept)
  left = quota - keep
  rest = np.bincount(gflat.ravel(), weights=left.ravel(), minlength=k * num_experts)
  rest_g = rest.take(gflat)
  remote = np.where(rest_g > 1e-9, left / np.maximum(rest_g, 1e-300), share)
  return kept, remote, rest.reshape(k, num_experts)


def local_parts(kept: np.ndarray) -> np.ndarray:
  """Kept fractions rounded down to whole parts of SHARE_PARTS (what the router applies):
  rounding down sends the few leftover tokens through the split, never over a quota."""
  return np.floor(kept * SHARE_PARTS + 1e-9) / SHARE_PARTS
