"""A run dir's history, kept: what a fresh start would overwrite, and what a resume changes.

A start at step 0 in a run dir that holds an earlier run's record (metrics past its first
checkpoint, damaged checkpoints) but nothing to resume from is refused, unless
`train.restart = True`, which moves those files into `RUN_DIR/previous.N/` first. A resume
compares the fields that shape training (batch, sequence length, top-k, the optimizer and its
schedule) with the checkpoint's record: a change is allowed, and said in one line each. JAX-free.
"""

from __future__ import annotations

import json
import os

from moejax.config import Config, ConfigError
from moejax.train.lock import LOCK_NAME

__all__ = ["TRAINING_FIELDS", "decay_steps", "earlier_run", "move_aside", "training_changes",
           "training_fields", "unsaved_start"]

# Fields a resume may change (unlike the model's), but not silently.
TRAINING_FIELDS = (("data", "global_batch_size"), ("data", "seq_len"), ("moe", "top_k"),
                   ("optim", "learning_rate"), ("optim", "warmup_steps"),
                   ("optim", "min_lr_ratio"), ("optim", "decay_steps"),
                   ("optim", "weight_decay"), ("optim", "b1"), ("optim", "b2"),
                   ("optim", "grad_clip_norm"))
METRICS, DAMAGED, ASIDE = "metrics.jsonl", "checkpoints_damaged", "previous"


def training_fields(cfg: Config) -> dict:
  """{"data.global_batch_size": 16, ...}: what a checkpoint records of how it was trained."""
  return {f"{part}.{name}": getattr(getattr(cfg, part), name) for part, name in TRAINING_FIELDS}


def decay_steps(cfg: Config, saved: dict | None) -> tuple[int, str | None]:
  """The learning-rate horizon of this start and, on a resume where it matters, the line that
  says which one runs: the config's `optim.decay_steps` when set, else the checkpoint's, else
  `train.num_steps` (a fresh run, or a checkpoint that predates the record)."""
  saved_steps = ((saved or {}).get("training") or {}).get("optim.decay_steps")
  if cfg.optim.decay_steps:
    return cfg.optim.decay_steps, None   # a change from the saved one is a training change
  if saved_steps:
    note = None
    if saved_steps != cfg.train.num_steps:
      note = (f"the learning-rate schedule continues as saved: optim.decay_steps={saved_steps} "
              f"(train.num_steps={cfg.train.num_steps}); set optim.decay_steps to change it")
    return int(saved_steps), note
  return cfg.train.num_steps, None


def training_changes(saved: dict, cfg: Config, where: str, step: int) -> list[str]:
  """One line per training field this config changes from the record of the checkpoint
  (`where`, at `step`)."""
  recorded = saved.get("training") or {}
  return [f"{name}={value!r} in this config, {recorded[name]!r} in {where}; steps from {step} "
          f"on use {value!r} (config.{step}.json in the run dir records it)"
          for name, value in training_fields(cfg).items()
          if name in recorded and recorded[name] != value]


def _last_step(path: str) -> int | None:
  last = None
  try:
    with open(path) as f:
      for line in f:
        try:
          step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
          continue
        last = step if last is None else max(last, step)
  except OSError:
    return None
  return last


def earlier_run(run_dir: str, every: int) -> str | None:
  """What of an earlier run a start at step 0 would overwrite (None: nothing): damaged
  checkpoints, or metrics that prove a checkpoint was complete and is gone. A step's record
  is written before the save that follows it, and a save waits for the one before, so only
  records of step 2 * `every` or later prove that checkpoint `every` was written; a run
  killed during its first save leaves records it redoes, nothing to keep."""
  found = []
  last = _last_step(os.path.join(run_dir, METRICS))
  if last is not None and last >= 2 * every:
    found.append(f"{METRICS} up to step {last}")
  damaged = os.path.join(run_dir, DAMAGED)
  if os.path.isdir(damaged) and os.listdir(damaged):
    found.append(f"damaged checkpoints in {damaged}")
  return " and ".join(found) or None


def unsaved_start(run_dir: str, every: int) -> str | None:
  """The line for a start at step 0 over an earlier start that saved no checkpoint (stopped
  before step `every`, or before its first step): there is nothing to resume, its steps are
  redone. None when the run dir holds no earlier start."""
  last = _last_step(os.path.join(run_dir, METRICS))
  if last is None and not os.path.exists(os.path.join(run_dir, "config.json")):
    return None
  reached = "no step" if last is None else f"step {last}"
  return (f"starting at step 0: no checkpoint in {os.path.join(run_dir, 'checkpoints')} yet "
          f"(an earlier start reached {reached}; the first save is at step {every}, "
          "checkpoint.every), so its steps are redone")


def refuse_fresh_start(run_dir: str, what: str) -> ConfigError:
  return ConfigError(
      f"train.run_dir={run_dir!r} holds an earlier run ({what}) but no checkpoint to resume "
      "from, and starting at step 0 would overwrite its record; set train.restart = True to "
      f"move its files into {os.path.join(run_dir, ASIDE)}.N/ and start over, or use a new "
      "train.run_dir.")


def move_aside(run_dir: str) -> str | None:
  """Moves every file of the run dir but its lock and its (empty) checkpoints/ into a new
  `previous.N/`; returns that path (None when there was nothing to move)."""
  names = [n for n in sorted(os.listdir(run_dir))
           if not n.startswith(LOCK_NAME) and n != "checkpoints" and
           not n.startswith(ASIDE + ".")]
  if not names:
    return None
  n = 1
  while os.path.exists(os.path.join(run_dir, f"{ASIDE}.{n}")):
    n += 1
  target = os.path.join(run_dir, f"{ASIDE}.{n}")
  os.makedirs(target)
  for name in names:
    os.rename(os.path.join(run_dir, name), os.path.join(target, name))
  return target
