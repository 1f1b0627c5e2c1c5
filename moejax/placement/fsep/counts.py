"""Replica counts: how many replicas each expert gets out of N x rounds slots (numpy only).

`even` gives every expert the same count (the remainder to the hottest), `dhondt` apportions
the slots by load (highest averages, every expert >= 1 and <= N), `blend` the same on load +
mean load. `snap_counts` then moves experts the router could only split coarsely to a
power-of-two count with even shares, whose router parts are exact.
"""

from __future__ import annotations

import numpy as np

from moejax.config import ConfigError
from moejax.layout.host_layout import SHARE_PARTS

CANDIDATES = ("even", "dhondt", "blend")      # every kind `replica_counts` knows


def even_counts(load_E: np.ndarray, total: int) -> np.ndarray:
  """`total` // E replicas each, one more for the (total % E) hottest experts."""
  num_experts = len(load_E)
  r = np.full(num_experts, total // num_experts, np.int64)
  rem = total % num_experts
  if rem:
    r[np.argsort(-load_E, kind="stable")[:rem]] += 1
  return r


def top_values(load_E: np.ndarray, first_k: np.ndarray, cap: int, take: int) -> np.ndarray:
  """How many of each expert's next values load_e / k, k = first_k[e], first_k[e] + 1, ...
  (k <= cap) are among the `take` largest of all of them; ties to the lower expert id.

  Only values at or above a lower bound on the take-th largest are built: the take-th largest
  of the experts' first values (one per expert) is one, since those are among all the values.
  At E = 256, N = 4096 that is ~1.3 x take values instead of E x take."""
  num_experts = len(load_E)
  m = min(take, cap)
  first = np.where(first_k <= cap, load_E / first_k, -np.inf)
  low = np.partition(first, num_experts - take)[num_experts - take] if take <= num_experts else 0.0
  count_E = np.minimum(cap + 1 - first_k, m)                            # values k <= cap
  if low > 0:                            # and load_e / k >= low: k <= load_e / low (+1: slack)
    count_E = np.minimum(count_E, np.minimum(np.floor(load_E / low), m + first_k) + 2 - first_k)
  count_E = np.maximum(count_E, 0).astype(np.int64)
  expert = np.repeat(np.arange(num_experts), count_E)                  # expert-major, k rising
  starts = np.cumsum(count_E) - count_E
  ks = first_k.take(expert) + (np.arange(len(expert)) - starts.take(expert))
  vals = load_E.take(expert) / ks
  top = np.argpartition(-vals, take - 1)[:take]
  thresh = vals[top].min()
  chosen = vals > thresh
  ties = np.flatnonzero(vals == thresh)[:take - int(chosen.sum())]   # expert-major order
  chosen[ties] = True
  return np.bincount(expert[chosen], minlength=num_experts)


def dhondt_counts(load_E: np.ndarray, total: int, cap: int) -> np.ndarray:
  """Highest averages (D'Hondt): every expert gets 1, each further replica goes to the expert
  with the largest load_e / r_e, at most `cap` per expert, `total` (<= E * cap) in all.

  Equivalent to taking the (total - E) largest values load_e / k, k = 2..cap, without building
  all E x cap of them: every value above total_load / total is taken (there are at most
  total - E of those), and only the few still missing are picked from each expert's next ones."""
  load_E = np.asarray(load_E, np.float64)
  num_experts = len(load_E)
  extra = total - num_experts
  if extra <= 0 or cap <= 1:
    return np.ones(num_experts, np.int64)
  if extra >= num_experts * (cap - 1):
    return np.full(num_experts, cap, np.int64)
  mass = load_E.sum()
  if mass <= 0:
    return even_counts(load_E, total)
  lam = mass / total * (1 + 1e-9)
  # Values load_e / k > lam for k in 2..cap: k < load_e / lam.
  above = np.clip(np.ceil(load_E / lam) - 2, 0, cap - 1).astype(np.int64)
  if above.sum() > extra:                                   # cannot happen; stay exact anyway
    above[:] = 0
  r = 1 + above
  missing = extra - int(above.sum())
  if missing > 0:
    r += top_values(load_E, r + 1, cap, missing)
  return r


def replica_counts(kind: str, load_E: np.ndarray, total: int, cap: int) -> np.ndarray:
  if kind == "even":
    return even_counts(load_E, total)
  if kind == "dhondt":
    return dhondt_counts(load_E, total, cap)
  if kind == "blend":
    return dhondt_counts(load_E + load_E.mean(), total, cap)
  raise ConfigError(f"fsep candidate {kind!r} is unknown; choose from {list(CANDIDATES)}.")


def snap_counts(r_E: np.ndarray, load_E: np.ndarray, total: int, cap: int,
                min_parts: int = 16, max_part: float = 0.02,
                kind: str = "dhondt") -> tuple[np.ndarray, np.ndarray]:
  """(replica counts, coarse mask [E]). The router splits an expert's tokens in whole parts of
  SHARE_PARTS; an expert with fewer than `min_parts` parts per replica, or one part above
  `max_part` of the mean device load ("coarse": a hot expert on many devices), cannot have its
  shares levelled finely, and rounding them costs balance (on N=1024 one part of the hottest
  expert is several percent of a device's load). Coarse experts therefore get the power-of-two
  replica count nearest theirs (at most min(cap, SHARE_PARTS); cap = N devices), so even
  shares are whole parts, and keep even shares; if that changes their total, the other
  experts are re-apportioned by the same rule (`kind`) over the remaining slots. Returns the
  counts unchanged and no coarse expert when that is impossible."""
  mean = load_E.sum() / cap
  coarse = (r_E * min_parts > SHARE_PARTS) | (load_E / SHARE_PARTS > max_part * mean)
  none = np.zeros(len(r_E), bool)
  if not coarse.any():
    return r_E, none
  top = 1 << (min(cap, SHARE_PARTS).bit_length() - 1)       # largest power of 2 allowed
  rc = r_E[coarse]
  lo = np.left_shift(1, np.floor(np.log2(rc)).astype(np.int64))
  snapped = np.minimum(np.where(rc - lo <= 2 * lo - rc, lo, 2 * lo), top)
  if np.array_equal(snapped, rc):
    return r_E, coarse
  fine = ~coarse
  rest = total - int(snapped.sum())
  if not int(fine.sum()) <= rest <= int(fine.sum()) * cap:
    return r_E, none
  out = r_E.copy()
  out[coarse] = snapped
  if fine.any():
    out[fine] = replica_counts(kind, load_E[fine], rest, cap)
  return out, coarse
