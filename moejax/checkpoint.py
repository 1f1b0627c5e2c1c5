"""Checkpoints with orbax: state in canonical expert order, layout and data position.

In `ep` mode expert weights (and their optimizer moments) are stored in slot
order; a checkpoint always holds them in expert-id order so that it restores
under any layout, and the layout itself is saved beside them.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from moejax.config import CheckpointConfig, ConfigError
from moejax.layout import Layout
from moejax.migrate import permute_slots
from moejax.planner.placement import SHARE_PARTS


def to_canonical(tree: Any, layout: Layout) -> Any:
  """Slot order -> expert-id order (row e = the expert e's weights)."""
  return permute_slots(tree, layout.expert_slot_LxE)


def from_canonical(tree: Any, layout: Layout) -> Any:
  """Expert-id order -> slot order of `layout`."""
  return permute_slots(tree, layout.slot_expert_LxS)


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def check_layout(layout: Layout, directory: str, step: int) -> None:
  """A restored layout must give every expert a slot and shares summing to SHARE_PARTS."""
  parts = np.asarray(layout.expert_parts_LxExR)
  slots = np.asarray(layout.expert_slots_LxExR)
  if np.any(parts.sum(-1) != SHARE_PARTS) or np.any((slots >= 0).sum(-1) == 0):
    raise ConfigError(f"checkpoint {directory}/{step} holds an invalid layout (an expert without "
                      f"a slot or shares not summing to {SHARE_PARTS}); delete that step to "
                      "fall back to the previous checkpoint.")


class Checkpointer:
  def __init__(self, run_dir: str, cfg: CheckpointConfig):
    self.cfg = cfg
    self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, state: Any, layout: Layout, meta: dict) -> None:
    canonical = {"state": to_canonical(state, layout), "layout": layout}
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(canonical), meta=ocp.args.JsonSave(dict(meta, step=step))))

  def restore(self, state_like: Any, layout_like: Layout, step: int | None = None):
    """Returns (state in its saved layout's slot order, layout, meta) of `step` or the latest."""
    step = self.latest_step() if step is None else step
    target = _abstract({"state": state_like, "layout": layout_like})
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    layout = out["state"]["layout"]
    check_layout(layout, self.directory, step)
    return from_canonical(out["state"]["state"], layout), layout, dict(out["meta"])

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()
