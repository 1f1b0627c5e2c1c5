"""The one device mesh and the one logical -> physical sharding rules table."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
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
    ("fsep_mlp", ("expert", "model")),     # fsep expert FFN dim: split over both axes
    ("layers", None),
)


_NAMES = [name for name, _ in RULES]
assert len(_NAMES) == len(set(_NAMES)), f"duplicate logical axis names in RULES: {_NAMES}"


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh of `cfg` (a -1 axis takes the devices left) over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  return mesh_of_shape(cfg.resolve(len(devices)), devices)


def mesh_of_shape(shape: tuple[int, int, int],
                  devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, expert, model) mesh of exactly `shape` on the first prod(shape) of `devices`
  (default: jax.devices()); tests and benchmarks pick meshes smaller than the host."""
  devices = list(jax.devices() if devices is None else devices)[: math.prod(shape)]
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(names: Sequence[str | None]) -> P:
  rules = dict(RULES)
  out = []
  for name in names:
    if name is not None and name not in rules:
      raise ConfigError(f"logical axis {name!r} has no rule in moejax.model.mesh.RULES; add one.")
    out.append(None if name is None else rules[name])
  return P(*out)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
