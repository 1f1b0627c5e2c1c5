"""Where each layer group's parameters are stored when the stages loop (circular schedule).

A pipeline of P stages and V virtual stages (chunks per stage) cuts the G layer groups into
P*V chunks of K = G/(P*V) groups; chunk c = r*P + s, the r-th chunk of stage s, computes groups
c*K .. c*K + K - 1. The scanned `layers` parameter axis is sharded over `stage` in contiguous
blocks of G/P, so stage s can hold its V chunks without moving data each step only if they
are stored together: storage row j = s*V*K + r*K + k holds canonical group (r*P + s)*K + k.
With V = 1 that is the identity, so GPipe and one stage store the Transformer's own order.

Parameters and their optimizer state are stored in this order; layouts, the balancing bias,
routing statistics, traces and checkpoints stay in the canonical order (layer l is the l-th
MoE layer a token meets), and the conversions below sit at the edges: the pipeline reorders
the layout it reads, migrations get their layouts reordered, checkpoints hold canonical rows.
"""

from __future__ import annotations

import jax
import numpy as np

from moejax.config import ConfigError
from moejax.layout.leaves import path_keys


def storage_order(groups: int, stages: int, virtual: int) -> np.ndarray:
  """int [G]: the canonical group stored at each storage row (a permutation)."""
  if groups % (stages * virtual):
    raise ConfigError(f"{groups} layer groups do not split into mesh.stage={stages} x "
                      f"train.virtual_stages={virtual} chunks; use a stage x virtual_stages "
                      f"product dividing {groups}.")
  k = groups // (stages * virtual)
  # storage rows in [stage, chunk, k] order; each one's canonical group
  stage, chunk, within = np.meshgrid(np.arange(stages), np.arange(virtual), np.arange(k),
                                     indexing="ij")
  return ((chunk * stages + stage) * k + within).reshape(-1)


def is_identity(order: np.ndarray) -> bool:
  return bool(np.array_equal(order, np.arange(order.shape[0])))


def reorder(tree, order: np.ndarray):
  """Every leaf's leading (layer) axis gathered by `order`: out[j] = leaf[order[j]]."""
  if is_identity(order):
    return tree
  return jax.tree.map(lambda a: a[order], tree)


def inverse(order: np.ndarray) -> np.ndarray:
  back = np.empty_like(order)
  back[order] = np.arange(order.shape[0])
  return back


def params_to(params: dict, order: np.ndarray) -> dict:
  """`params` (canonical) with the layer-group subtrees (`layers`, `fsep_experts`: their
  leading axis is the group's) in storage `order`; `inverse(order)` goes back."""
  return dict(params, **reorder({k: v for k, v in params.items()
                                 if k in ("layers", "fsep_experts")}, order))


def reorder_state(tree, order: np.ndarray):
  """A train state (or any tree holding parameters and their optimizer moments) with every
  layer-group leaf, i.e. one under `layers` or `fsep_experts`, gathered by `order`."""
  if is_identity(order):
    return tree

  def one(path, leaf):
    keys = path_keys(path)
    return leaf[order] if "layers" in keys or "fsep_experts" in keys else leaf
  return jax.tree_util.tree_map_with_path(one, tree)
