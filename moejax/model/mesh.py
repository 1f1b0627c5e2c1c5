"""The one device mesh and the one logical -> physical sharding rules table."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from moejax.config import ConfigError, MeshConfig

AXES = ("data", "expert", "model")
STAGE = "stage"           # the pipeline axis; on the mesh only when mesh.stage > 1
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


# The parameter rules' overrides (moejax.train.state), applied to RULES and nowhere else.
# FSDP (ZeRO-3): every parameter's embed dim over `data`, so a parameter and its Adam moments
# hold 1/data of it on each device; XLA's SPMD partitioner all-gathers it where it is used and
# reduce-scatters its gradient. Activations keep RULES: their batch dim already uses `data`.
FSDP_RULES = (("embed", "data"),)
# Pipeline: the scanned layer-group axis over `stage`, whole groups per stage.
STAGE_RULES = (("layers", "stage"),)


def param_rules(fsdp: bool = False, stage: bool = False) -> tuple[tuple[str, object], ...]:
  """RULES with the FSDP and stage overrides for parameters (and their optimizer state)."""
  overrides = dict((FSDP_RULES if fsdp else ()) + (STAGE_RULES if stage else ()))
  return tuple((name, overrides.get(name, axes)) for name, axes in RULES)


_NAMES = [name for name, _ in RULES]
assert len(_NAMES) == len(set(_NAMES)), f"duplicate logical axis names in RULES: {_NAMES}"


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh of `cfg` (a -1 axis takes the devices left) over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  return mesh_of_shape(cfg.resolve(len(devices)), devices, cfg.stage)


def mesh_of_shape(shape: tuple[int, int, int], devices: Sequence[jax.Device] | None = None,
                  stage: int = 1) -> Mesh:
  """A (data, expert, model) mesh of exactly `shape` on the first prod(shape) of `devices`
  (default: jax.devices()); tests and benchmarks pick meshes smaller than the host. With
  `stage` > 1 the mesh gains a leading `stage` axis of that size (and stage times the
  devices); with 1 it has none, so one-stage programs are as before."""
  shape, axes = ((stage,) + tuple(shape), (STAGE,) + AXES) if stage > 1 else (shape, AXES)
  devices = list(jax.devices() if devices is None else devices)[: math.prod(shape)]
  return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)


def num_stages(mesh: Mesh) -> int:
  return mesh.shape.get(STAGE, 1)


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


def sharding_table(tree) -> list[tuple[str, tuple, str]]:
  """(path, shape, PartitionSpec) of every array leaf of `tree`: where each lies on its mesh."""
  rows = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    spec = getattr(leaf.sharding, "spec", None)
    rows.append((jax.tree_util.keystr(path), tuple(leaf.shape), str(spec)))
  return rows
