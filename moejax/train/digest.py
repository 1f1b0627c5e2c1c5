"""Content digests of array trees, to catch checkpoint bytes that changed after the save.

Per leaf, two sums modulo 2**32 over the raw bits read as uint32 words u_i (i = flat index):
sum(u_i) and sum(u_i * (i + 1)). Integer sums do not depend on the reduction order, so a digest
is the same under any sharding, mesh or process count: a checkpoint restored elsewhere (another
mesh, another strategy) is checked against the digest taken when it was saved.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}
_JITS: dict = {}


def path_name(path) -> str:
  """A path as 'a/b/0/c', the same for dicts, dataclasses, tuples and namedtuples."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _words(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  u = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])   # 8-byte: adds a dim of 2
  return u.astype(jnp.uint32)


def _leaf_digest(x: jax.Array) -> jax.Array:
  u = _words(x)
  index = jnp.zeros(u.shape, jnp.uint32)
  stride = 1
  for d in reversed(range(u.ndim)):   # flat index from iotas: stays sharded like x
    index = index + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d) * np.uint32(stride % 2**32)
    stride *= u.shape[d]
  return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * (index + 1), dtype=jnp.uint32)])


def _digest_leaves(leaves):
  return [_leaf_digest(x) for x in leaves]


def tree_digest(tree: Any) -> dict[str, list[int]]:
  """{path: [sum, weighted sum]} of every array leaf (blocks until the leaves are ready)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not flat:
    return {}
  names = [path_name(p) for p, _ in flat]
  leaves = [x for _, x in flat]
  sharding = leaves[0].sharding
  mesh = getattr(sharding, "mesh", None)
  out_sh = NamedSharding(mesh, P()) if mesh is not None else None
  if out_sh not in _JITS:
    _JITS[out_sh] = jax.jit(_digest_leaves, out_shardings=out_sh)
  sums = jax.device_get(_JITS[out_sh](leaves))
  return {n: [int(v) for v in s] for n, s in zip(names, sums)}


def leafwise_digest(tree: Any) -> dict[str, list[int]]:
  """`tree_digest`, one XLA program per array: its temporaries (twice the array's bytes on
  CPU) are those of the largest array, not of the whole tree; a program per distinct shape."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    (name, value), = tree_digest({path_name(path): x}).items()
    out[name] = value
  return out


def mismatches(tree: Any, expected: dict[str, list[int]]) -> list[str]:
  """Paths whose digest differs from `expected` (or that are missing on either side)."""
  got = tree_digest(tree)
  return sorted(n for n in set(got) | set(expected) if got.get(n) != expected.get(n))
