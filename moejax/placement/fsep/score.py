"""How the fsep planner scores its candidate layouts on predicted counts (numpy only).

Candidates are Y layouts grid[cands, N, rounds] (the expert of each replica, one per (device,
expert)) with token shares share[cands, N, rounds]; counts are folded onto devices first.
"""

from __future__ import annotations

import numpy as np

from moejax.placement.fsep.deal import LARGE_MESH


def own_counts(grid: np.ndarray, dev_NxE: np.ndarray) -> np.ndarray:
  """[cands, N, rounds]: device d's own count of the expert of each of its replicas."""
  n, num_experts = dev_NxE.shape
  return dev_NxE.ravel().take(grid + (np.arange(n) * num_experts)[None, :, None])


def estimate(grid: np.ndarray, share: np.ndarray, dev_NxE: np.ndarray,
             load_E: np.ndarray, kept: np.ndarray | None = None,
             remote: np.ndarray | None = None, own: np.ndarray | None = None,
             total_N: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(device load [cands, N], tokens each device sends off itself [cands, N]) under the "split"
  routing of the dense dispatch on the counts dev_NxE, for replicas grid[cands, N, rounds] (one
  per (device, expert)) with token shares share[cands, N, rounds]. Without `kept`, each source
  splits its tokens for e by the shares, so it keeps share x own tokens local; with the kept
  fraction kept[cands, N, rounds] of a device's own tokens and the shares `remote` of the rest
  (`locality.keep_local`), it keeps kept x own + remote x (1 - kept) x own. `own`
  (own_counts) and `total_N` (dev_NxE's row sums) may be passed when already computed."""
  own = own_counts(grid, dev_NxE) if own is None else own
  total_N = np.einsum("ne->n", dev_NxE) if total_N is None else total_N
  local = own * share if kept is None else own * (kept + remote * (1.0 - kept))
  return device_load(grid, share, load_E), total_N[None, :] - np.einsum("knr->kn", local)


def device_load(grid: np.ndarray, share: np.ndarray, load_E: np.ndarray) -> np.ndarray:
  """[cands, N]: each device's quota load, the first half of `estimate`."""
  return np.einsum("knr->kn", share * load_E.take(grid))


def overflow(grid: np.ndarray, share: np.ndarray, dev_NxE: np.ndarray,
             cap_N: np.ndarray, pooled: bool = False) -> np.ndarray:
  """Dropped share [cands] of all choices when source device s sends dev_NxE[s, e] x share to
  each replica of e (grid[cands, N, rounds], share[cands, N, rounds]) and a (source, slot) pair
  takes at most cap_N[s] rows (pooled: a (source, device) pair, its slots' rows summed). An
  estimate for ranking candidates: mean counts (no spread), no rounding of the capacity, and
  sources already folded onto their expert-axis device (with data > 1, sources that differ
  overflow more than this says). Per (source, slot) with sources of unequal caps, memory
  grows as Y x N^2 x rounds (about 1 GB at N=1024, C=64); the other cases hold N^2 at most."""
  if pooled:
    return _pooled_overflow(grid, share, dev_NxE, cap_N)
  if np.all(cap_N == cap_N[0]):
    return _slot_overflow(grid, share, dev_NxE, float(cap_N[0]))
  rows_candsxNxNxC = dev_NxE[:, grid].transpose(1, 0, 2, 3) * share[:, None]
  over = np.maximum(rows_candsxNxNxC - cap_N[None, :, None, None], 0.0).sum((1, 2, 3))
  return over / max(float(dev_NxE.sum()), 1e-12)


def _pooled_overflow(grid, share, dev_NxE, cap_N):
  """`overflow` per (source, device): the rows source s sends device d are
  sum_r dev[s, grid[d, r]] x share[d, r], one matrix product dev_NxE @ M per candidate with
  M[e, d] = the share of e's replica on d: N x N per candidate, not the N x N x rounds rows
  (1 GB at N = 4096)."""
  n, num_experts = dev_NxE.shape
  dev_of = np.broadcast_to(np.arange(n)[:, None], grid.shape[1:])
  over = np.empty(len(grid))
  for y in range(len(grid)):
    share_ExN = np.zeros((num_experts, n))
    np.add.at(share_ExN, (grid[y], dev_of), share[y])
    rows_NxN = dev_NxE @ share_ExN
    over[y] = np.maximum(rows_NxN - cap_N[:, None], 0.0).sum()
  return over / max(float(dev_NxE.sum()), 1e-12)


def _slot_overflow(grid, share, dev_NxE, cap):
  """`overflow` per (source, slot) with one cap for every source, without the [cands, N, N, C]
  rows: a replica of e with share q overflows by sum_s max(dev[s, e] q - cap, 0)
  = q x (sum of dev[:, e] above cap / q, less their count x cap / q), read off each expert's
  sorted counts and their suffix sums."""
  n, num_experts = dev_NxE.shape
  sorted_NxE = np.sort(dev_NxE, axis=0)
  suffix = np.concatenate([np.cumsum(sorted_NxE[::-1], axis=0)[::-1], np.zeros((1, num_experts))])
  q = share.reshape(len(share), -1)
  e = grid.reshape(len(grid), -1)
  level = np.where(q > 0, cap / np.maximum(q, 1e-300), np.inf)
  # sources above the level: those from the first sorted count > level on
  first = np.empty(e.shape, np.int64)
  for y in range(len(grid)):                     # per candidate: one searchsorted per expert
    for ex in np.unique(e[y]):
      at = e[y] == ex
      first[y, at] = np.searchsorted(sorted_NxE[:, ex], level[y, at], side="right")
  above = suffix[first, e] - (n - first) * level
  over = np.where(q > 0, q * above, 0.0).sum(1)
  return over / max(float(dev_NxE.sum()), 1e-12)


def column_sums(dev_NxE: np.ndarray) -> np.ndarray:
  """[E]: each expert's count over the devices, dev_NxE.sum(0) in another order where there
  are many rows. numpy sums axis 0 row by row, one inner loop of E adds per row: at
  N = 4096, E = 256 that loop overhead, not memory, sets the time. Summed over groups of 4
  rows first (inner loops of 4E, a quarter as many) it takes ~0.7x as long. Fewer than
  LARGE_MESH rows keep the plain sum, and so its last bits."""
  n, num_experts = dev_NxE.shape
  if n < LARGE_MESH or n % 4 or not dev_NxE.flags.c_contiguous:
    return dev_NxE.sum(0)
  return dev_NxE.reshape(n // 4, 4 * num_experts).sum(0).reshape(4, num_experts).sum(0)


def fold_sources(pred_WxE: np.ndarray, src_dev_W: np.ndarray, n: int) -> np.ndarray:
  """[N, E]: counts of the sources on each device summed."""
  src = np.asarray(src_dev_W, np.int64)
  if len(src) == n and np.array_equal(src, np.arange(n)):
    return pred_WxE
  order = np.argsort(src, kind="stable")
  src_sorted = src[order]
  starts = np.searchsorted(src_sorted, np.arange(n))
  has = np.searchsorted(src_sorted, np.arange(n), side="right") > starts
  out = np.zeros((n, pred_WxE.shape[1]))
  if has.any():
    out[has] = np.add.reduceat(pred_WxE[order], starts[has], axis=0)
  return out
