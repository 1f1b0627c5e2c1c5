"""Snapshot of every parameter's PartitionSpec per mesh: catches silent resharding.

To accept an intended change: MOEJAX_UPDATE_SNAPSHOTS=1 pytest tests/test_sharding_snapshot.py
"""

from __future__ import annotations

import json
import os

import jax
import pytest

from moejax.config import OptimConfig
from moejax.layout.tables import static_layout
from moejax.model.mesh import mesh_of_shape
from moejax.model.transformer import Transformer
from moejax.train.optim import optimizer
from moejax.train.state import state_shardings
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE

SNAPSHOT_DIR = os.path.join(os.path.dirname(__file__), "snapshots")


def _specs(shape) -> dict[str, str]:
  mesh = mesh_of_shape(shape)
  model = Transformer(TINY_MODEL, TINY_MOE, mesh)
  layout = static_layout(TINY_MODEL.num_layers // TINY_MOE.moe_every, TINY_MOE.num_experts,
                         shape[1])
  sh = state_shardings(model, optimizer(OptimConfig(), 10), mesh, layout, BATCH, SEQ)
  return {jax.tree_util.keystr(p): str(s.spec)
          for p, s in jax.tree_util.tree_leaves_with_path(sh.params)}


@pytest.mark.parametrize("shape", [(2, 4, 1), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_param_shardings_match_snapshot(shape):
  path = os.path.join(SNAPSHOT_DIR, f"shardings_{'x'.join(map(str, shape))}.json")
  got = _specs(shape)
  if os.environ.get("MOEJAX_UPDATE_SNAPSHOTS"):
    with open(path, "w") as f:
      json.dump(got, f, indent=1, sort_keys=True)
  with open(path) as f:
    want = json.load(f)
  assert got == want, (f"parameter shardings changed for mesh {shape}; if intended, rerun with "
                       "MOEJAX_UPDATE_SNAPSHOTS=1 and commit the new snapshot")
