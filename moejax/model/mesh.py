"""The one device mesh and the one logical -> physical sharding rules table."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from moejax.config import ConfigError, MeshConfig

AXES = ("data", "expert", "model")
BATCH_AXES = ("data", "expert")

# Logical axis name -> mesh axis (or axes, or None = replicated). The only table.
RULES: tuple[tuple[str, object], ...] = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("embed", None),
    ("vocab", "model"),
    ("heads", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("expert", "expert"),
    ("expert_mlp", "model"),
    ("fsep_mlp", ("expert", "model")),     # fsep expert FFN dim: 1/(N*M) per device
    ("layers", None),
)


_NAMES = [name for name, _ in RULES]
assert len(_NAMES) == len(set(_NAMES)), f"duplicate logical axis names in RULES: {_NAMES}"


def resolve_axis_sizes(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """Replaces a single -1 by the remaining factor; checks the product."""
  sizes = [cfg.data, cfg.expert, cfg.model]
  bad = [(n, s) for n, s in zip(AXES, sizes) if s == 0 or s < -1]
  if bad:
    raise ConfigError(f"mesh.{bad[0][0]}={bad[0][1]} is invalid; use a positive size or -1.")
  if sizes.count(-1) > 1:
    raise ConfigError(f"mesh sizes {dict(zip(AXES, sizes))} have more than one -1; "
                      "set all but one axis explicitly.")
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if num_devices % known:
      raise ConfigError(
          f"mesh sizes {dict(zip(AXES, sizes))} cannot fill {num_devices} devices: "
          f"{num_devices} is not divisible by {known}.")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ConfigError(
        f"mesh sizes {dict(zip(AXES, sizes))} multiply to {math.prod(sizes)} but there are "
        f"{num_devices} devices; make the product {num_devices} or set one axis to -1.")
  return tuple(sizes)


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_axis_sizes(cfg, len(devices))
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_of_shape(shape: tuple[int, int, int]) -> Mesh:
  """A (data, expert, model) mesh on the first prod(shape) local devices (tests)."""
  devices = jax.devices()[: math.prod(shape)]
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(names: Sequence[str | None]) -> P:
  rules = dict(RULES)
  out = []
  for name in names:
    if name is not None and name not in rules:
      raise ConfigError(f"logical axis {name!r} has no rule in moejax.mesh.RULES; add one.")
    out.append(None if name is None else rules[name])
  return P(*out)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def num_batch_shards(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
