"""Checkpoints with orbax: canonical expert order, layout, data position, and a content digest.

A checkpoint holds the state with expert weights in canonical expert-id order (`ep` slots are
un-permuted by the layout; see `moejax.layout.canonical`), the layout beside it, and JSON meta:
step, data position, planner state, expert mode, and a digest of every array (`moejax.digest`),
taken before the save so that it commits atomically with the arrays.

Restoring (`Checkpointer.restore`):
- reads straight into the shardings of the *current* strategy, whatever mesh or expert mode the
  checkpoint was saved under (elastic restore): the target is the current state converted to
  the saved tree paths, and the result is converted back (`convert.convert_tree`);
- keeps the saved layout if it fits the current strategy, else starts from `layout_like`;
- treats a step that fails to read, or whose digest differs, as damaged: moves it to
  `checkpoints_damaged/` and falls back to the previous step, with a warning. All processes
  agree on each outcome, and nothing is handed back unless it was fully read and verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from moejax.config import CheckpointConfig, Config, ConfigError
from moejax.layout.canonical import (
  canonical_state,
  convert_tree,
  from_canonical,
  from_canonical_state,
  to_canonical,
)
from moejax.layout.host_layout import SHARE_PARTS
from moejax.layout.tables import Layout
from moejax.runtime import distributed
from moejax.train import digest as digest_lib, faults
from moejax.train.state import TrainState, abstract

__all__ = ["Checkpointer", "CheckpointError", "Restored", "check_layout", "from_canonical",
           "model_fields", "to_canonical"]
LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout))
BIAS = "router_bias_LxE"   # the train state's field that checkpoints before 2026-11-24 lack
# The fields that give the saved arrays their shapes; strategy fields (mesh, expert mode,
# capacity) may change on resume, these may not.
MODEL_FIELDS = (("model", "vocab_size"), ("model", "d_model"), ("model", "num_layers"),
                ("model", "num_heads"), ("model", "num_kv_heads"), ("model", "head_dim"),
                ("model", "qk_norm"), ("model", "d_ff"), ("model", "max_seq_len"),
                ("model", "kv_lora_rank"), ("model", "q_lora_rank"), ("model", "v_head_dim"),
                ("model", "qk_nope_head_dim"), ("model", "qk_rope_head_dim"),
                ("model", "mtp_depth"), ("moe", "num_experts"), ("moe", "d_ff"),
                ("moe", "moe_every"), ("moe", "first_dense"), ("moe", "num_shared_experts"),
                ("moe", "shared_d_ff"))


def model_fields(cfg: Config) -> dict[str, int | str]:
  """{"model.d_model": 128, ...}: what a checkpoint records of the model it holds."""
  return {f"{part}.{name}": getattr(getattr(cfg, part), name) for part, name in MODEL_FIELDS}


class CheckpointError(ConfigError):
  """No usable checkpoint, or one saved for another model: one line with the fix."""


class DamagedCheckpoint(Exception):
  """A checkpoint step that cannot be read back intact."""


@dataclasses.dataclass
class Restored:
  step: int
  state: Any          # in the current strategy's tree, shardings and slot order
  layout: Layout
  meta: dict
  warnings: list[str]


def _first_line(e: BaseException) -> str:
  text = str(e).strip().split(" See full TensorStore details")[0]
  return (text.splitlines()[0] if text else type(e).__name__)[:200]


def check_layout(layout: Layout, directory: str, step: int) -> None:
  """A restored layout must give every expert a slot and shares summing to SHARE_PARTS."""
  parts = np.asarray(layout.expert_parts_LxExR)
  slots = np.asarray(layout.expert_slots_LxExR)
  if np.any(parts.sum(-1) != SHARE_PARTS) or np.any((slots >= 0).sum(-1) == 0):
    raise ConfigError(f"checkpoint {directory}/{step} holds an invalid layout (an expert without "
                      f"a slot or shares not summing to {SHARE_PARTS}); delete that step to "
                      "fall back to the previous checkpoint.")


def _saved_arrays(mngr: ocp.CheckpointManager, step: int) -> dict[str, dict[str, Any]]:
  """{'state': {path: metadata}, 'layout': {...}} of a step, from orbax's metadata files."""
  tree = mngr.item_metadata(step)["state"]
  if tree is None:
    raise DamagedCheckpoint("no array metadata")
  out: dict[str, dict[str, Any]] = {"state": {}, "layout": {}}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    top, _, rest = digest_lib.path_name(path).partition("/")
    out.setdefault(top, {})[rest] = leaf
  return out


def _check_compatible(saved: dict, target: Any, directory: str, step: int) -> None:
  want = {digest_lib.path_name(p): x.shape
          for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
  for name in sorted(set(want) | set(saved)):
    if name not in saved or name not in want or tuple(saved[name].shape) != tuple(want[name]):
      have = tuple(saved[name].shape) if name in saved else "nothing"
      need = tuple(want[name]) if name in want else "nothing"
      raise CheckpointError(
          f"checkpoint {directory}/{step} was saved for another model: state/{name} holds "
          f"{have}, this config needs {need}; use the run's own config or a new train.run_dir.")


def _disk_bytes(directory: str) -> int:
  """Bytes a directory's files take on disk (allocated blocks, as `du` counts them)."""
  total = 0
  for root, _, files in os.walk(directory):
    for name in files:
      with contextlib.suppress(OSError):
        total += os.stat(os.path.join(root, name)).st_blocks * 512
  return total


class Checkpointer:
  def __init__(self, run_dir: str, cfg: CheckpointConfig):
    self.cfg = cfg
    self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    self.damaged_directory = os.path.abspath(os.path.join(run_dir, "checkpoints_damaged"))
    self._mngr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                             cleanup_tmp_directories=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    self._await_cleanup()
    # The room one more checkpoint needs: the larger of the state's bytes (set by the trainer)
    # and the latest complete checkpoint's size on disk.
    self.needed_bytes = 0
    self._in_flight: int | None = None   # the step of the last save started

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def save(self, step: int, state: Any, layout: Layout, meta: dict,
           expert_mode: str = "ep", canonical: bool = False) -> None:
    """Starts writing `step` (orbax finishes it in the background, into a temporary directory
    renamed when complete). A write that fails, now or in the background of the previous
    save, raises `faults.WriteError`; the complete checkpoints before it stay as they were.
    `canonical`: `state` is in expert-id order already (no copy of the expert leaves), and
    its digest is taken array by array (`digest.leafwise_digest`: a converter's host memory)."""
    if not canonical:
      state = canonical_state(state, layout, expert_mode)
    item = {"state": state, "layout": layout}
    digest = (digest_lib.leafwise_digest if canonical else digest_lib.tree_digest)(item)
    meta = dict(meta, step=step, expert_mode=expert_mode, digest=digest)
    self.wait()   # orbax would wait here too; this way a failure names the step it belongs to
    latest = self._complete_steps()
    self.needed_bytes = max(self.needed_bytes, _disk_bytes(
        os.path.join(self.directory, str(latest[-1]))) if latest else 0)
    self._in_flight = step
    with self.writing(f"checkpoint step {step}"):
      self._mngr.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(item), meta=ocp.args.JsonSave(meta)))

  @contextlib.contextmanager
  def writing(self, what: str, path: str | None = None):
    """Turns a failed write of `what` to `path` (default: the checkpoint directory) into one
    line: the path, the free space, the room one more checkpoint needs, the resume point."""
    try:
      yield
    except Exception as e:
      cause = faults.disk_error(e)
      if cause is None:
        raise
      latest = self._complete_steps()
      resume = f"step {latest[-1]} in {self.directory}" if latest else "step 0 (no checkpoint)"
      raise faults.write_error(cause, what, path or self.directory, self.needed_bytes,
                               resume) from None

  def _complete_steps(self) -> list[int]:
    """Steps whose directory is complete on disk (orbax renames a step's directory into place
    only once it is written)."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())

  def latest_meta(self) -> dict | None:
    """The JSON meta of the latest complete step; None when there is none or it does not read
    (`restore` then finds out which step is intact)."""
    step = self.latest_step()
    if step is None:
      return None
    try:
      meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      return dict(meta["meta"], step=step)
    except Exception:
      return None

  def check_model(self, fields: dict[str, int | str], fixed_by_data: dict[str, str] | None = None
                  ) -> None:
    """Before any work: a run dir whose latest checkpoint holds another model (`model_fields`
    of its config) stops with one line naming the first field that differs and both values.
    `fixed_by_data`: {field: what fixes it}, fields the data decides (a prepared directory's
    vocabulary), where setting the field to the checkpoint's value cannot help. Steps that
    predate these records, or whose meta does not read, are left to `restore`."""
    meta = self.latest_meta()
    if meta is None:
      return
    step, saved = meta["step"], dict(meta.get("model") or {})
    for name, value in fields.items():
      if name in saved and saved[name] != value:
        where = f"checkpoint {self.directory}/{step} holds another model: {name}={saved[name]} " \
                f"there, {name}={value} in this config"
        if name in (fixed_by_data or {}):
          raise CheckpointError(f"{where} ({fixed_by_data[name]}); a model keeps its {name}, so "
                                "train this one in a new run dir: set train.run_dir to a new "
                                "directory.")
        raise CheckpointError(f"{where}; set {name} = {saved[name]} to resume it, or use a new "
                              "train.run_dir for this model.")

  def restore(self, state_like: Any, layout_like: Layout, expert_mode: str = "ep",
              step: int | None = None) -> Restored | None:
    """The latest intact checkpoint (or `step`) in the current strategy; None if there is none.

    `state_like` / `layout_like`: the current strategy's state and its initial layout (their
    shapes and shardings are the restore target; their values are not used).
    """
    steps = [step] if step is not None else self.all_steps()[::-1]
    if not steps:
      return None
    warnings: list[str] = []
    for s in steps:
      try:
        result, error = self._read(s, state_like, layout_like, expert_mode), None
      except CheckpointError:
        raise
      except Exception as e:   # orbax / tensorstore / json errors: the files are damaged
        result, error = None, e
      if distributed.all_true(error is None) and result is not None:
        result.warnings[:0] = warnings
        return result
      reason = _first_line(error) if error is not None else "unreadable on another process"
      moved = self._quarantine(s)
      warnings.append(f"checkpoint {self.directory}/{s} is damaged ({reason}); moved it to "
                      f"{moved} and fell back to the previous checkpoint")
    raise CheckpointError(
        f"no intact checkpoint in {self.directory} (tried steps {steps}; damaged ones are in "
        f"{self.damaged_directory}); restore a backup into {self.directory}, or start over: "
        "in this run dir with train.restart = True (the earlier files are kept aside), or in a "
        "new train.run_dir.")

  def restore_weights(self, state_like: TrainState, layout_like: Layout,
                      expert_mode: str = "ep") -> Restored:
    """The latest checkpoint's weights (`train.init_from`), in the current strategy; its
    `state` holds the params only. Reads a weights-only checkpoint (`python -m moejax.convert
    from_hf`) or a whole train state."""
    step = self.latest_step()
    if step is None:
      raise CheckpointError(
          f"train.init_from: {self.directory} holds no checkpoint; give a run dir written by "
          "`python -m moejax.convert from_hf` or one that trained.")
    saved = _saved_arrays(self._mngr, step)["state"]
    weights_only = not any(n.startswith("opt_state") for n in saved)
    like = state_like.replace(opt_state=None) if weights_only else state_like
    return self.restore(like, layout_like, expert_mode, step=step)

  def read_params(self, step: int | None = None, bias: bool = False) -> tuple[dict, dict]:
    """(params in canonical ep paths and expert-id order, on one device; the step's meta) of
    `step` (default: the latest), the optimizer state left unread; digests checked. `bias`:
    the router bias too, as params[BIAS] (where the checkpoint holds one)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"{self.directory} holds no checkpoint to read.")
    saved = _saved_arrays(self._mngr, step)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict = {}
    for name, m in saved["state"].items():
      if name.startswith("params/"):
        node = params
        *parents, leaf = name.split("/")[1:]
        for key in parents:
          node = node.setdefault(key, {})
        node[leaf] = jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=one)
    meta = dict(self._mngr.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"])
    target = {"state": {"params": params}}
    if bias and (m := saved["state"].get(BIAS)) is not None:
      target["state"][BIAS] = jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=one)
    with ocp.PyTreeCheckpointer() as reader:
      item = reader.restore(os.path.join(self.directory, str(step), "state"),
                            args=ocp.args.PyTreeRestore(
                                target, ocp.checkpoint_utils.construct_restore_args(target),
                                partial_restore=True))
    got = digest_lib.leafwise_digest(item)
    bad = [n for n, d in got.items() if n in meta.get("digest", {}) and meta["digest"][n] != d]
    if bad:
      raise CheckpointError(f"checkpoint {self.directory}/{step}: {bad[0]} differs from its "
                            "digest; the files are damaged.")
    src_mode = "fsep" if "fsep_experts" in item["state"]["params"] else "ep"
    out = convert_tree(item["state"]["params"], src_mode, "ep")
    return (dict(out, **{BIAS: item["state"][BIAS]}) if BIAS in item["state"] else out), meta

  def _read(self, step: int, state_like: Any, layout_like: Layout, expert_mode: str) -> Restored:
    saved = _saved_arrays(self._mngr, step)
    src_mode = "fsep" if any(n.startswith("params/fsep_experts/") for n in saved["state"]) else "ep"
    target_state = convert_tree(abstract(state_like), expert_mode, src_mode)
    # A checkpoint from before the balancing bias was train state holds no router_bias_LxE: it
    # restores with the zero bias a fresh run starts from, rather than as another model's.
    without_bias = BIAS not in saved["state"]
    if without_bias:
      target_state = {f.name: getattr(target_state, f.name)
                      for f in dataclasses.fields(target_state) if f.name != BIAS}
    _check_compatible(saved["state"], target_state, self.directory, step)
    rep = jax.tree.leaves(layout_like)[0].sharding
    target_layout = {n: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=rep)
                     for n, m in saved["layout"].items()}
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"state": target_state, "layout": target_layout}),
        meta=ocp.args.JsonRestore()))
    item, meta = out["state"], dict(out["meta"])
    if "digest" in meta:
      bad = digest_lib.mismatches(item, meta["digest"])
      if bad:
        raise DamagedCheckpoint(f"content digest differs for {len(bad)} arrays, e.g. {bad[0]}")
    warnings = []
    saved_layout = item["layout"]
    fits = (src_mode == expert_mode and set(saved_layout) == set(LAYOUT_FIELDS) and
            all(saved_layout[n].shape == getattr(layout_like, n).shape for n in LAYOUT_FIELDS))
    if fits:
      layout = Layout(**saved_layout)
      try:
        check_layout(layout, self.directory, step)
      except ConfigError as e:
        raise DamagedCheckpoint(_first_line(e)) from None
    else:
      layout = layout_like
      warnings.append(
          f"checkpoint {self.directory}/{step} was saved in {src_mode} mode with a layout that "
          f"does not fit this {expert_mode} strategy; experts keep their weights (canonical "
          "order) and start from this strategy's initial layout")
    state = item["state"]
    if without_bias:
      bias = state_like.router_bias_LxE
      state = TrainState(**state, router_bias_LxE=jax.device_put(
          np.zeros(bias.shape, bias.dtype), bias.sharding))
    state = convert_tree(state, src_mode, expert_mode)
    state = from_canonical_state(state, layout, expert_mode)
    meta["expert_mode_saved"] = src_mode
    return Restored(int(meta.get("step", step)), state, layout, meta, warnings)

  def _quarantine(self, step: int) -> str:
    """Moves a damaged step out of orbax's way (process 0), so it is neither read nor reused."""
    target = os.path.join(self.damaged_directory, str(step))
    if jax.process_index() == 0:
      os.makedirs(self.damaged_directory, exist_ok=True)
      n = 1
      while os.path.exists(target):
        target = os.path.join(self.damaged_directory, f"{step}.{n}")
        n += 1
      src = os.path.join(self.directory, str(step))
      if os.path.exists(src):
        shutil.move(src, target)
    distributed.barrier(f"moejax_quarantine_{step}")
    self._mngr.reload()
    return target

  def wait(self) -> None:
    with self.writing(f"checkpoint step {self._in_flight}"):
      self._mngr.wait_until_finished()

  def _await_cleanup(self) -> None:
    """Waits for the thread orbax starts with the manager to clear temporary directories of
    killed saves: one still running when the interpreter exits (a run stopped by an error
    right after start-up) fails with a traceback on the way out ("cannot schedule new
    futures after interpreter shutdown"). The manager has no public call for it."""
    wait = getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", None)
    if wait is not None:
      wait()

  def close(self) -> None:
    """Stops orbax's threads (before the interpreter shuts down, which they would outlive) and
    removes the checkpoint directory if nothing was ever written into it."""
    try:
      self._await_cleanup()
      with self.writing(f"checkpoint step {self._in_flight}"):
        self._mngr.close()
    finally:
      if jax.process_index() == 0:
        with contextlib.suppress(OSError):
          os.rmdir(self.directory)   # only when empty
