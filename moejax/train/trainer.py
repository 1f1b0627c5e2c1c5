"""The training loop: build everything from a Config, resume, train, evaluate, save."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import jax
import numpy as np
from tqdm import tqdm

from moejax.config import Config, ConfigError
from moejax.placement.trace import TraceRecorder
from moejax.train import (
  data as data_lib,
  faults,
  history as history_lib,
  metrics as metrics_lib,
  preempt,
  run_files as run_files_lib,
  step as step_lib,
)
from moejax.train.balance import BalanceTally
from moejax.train.checkpoint import Checkpointer, model_fields
from moejax.train.controllers import Hook, LayoutReplanning, StrategySwitching
from moejax.train.lock import RunDirBusy, RunDirLock, take_run_dir
from moejax.train.optim import optimizer, schedule
from moejax.train.pool import StrategyPool
from moejax.train.programs import initial_layout
from moejax.train.state import init_state
from moejax.train.tensorboard import tensorboard_hooks

__all__ = ["Hook", "Trainer", "initial_layout", "take_run_dir", "train"]

log = logging.getLogger("moejax")


class Trainer:
  """One run's pieces: the strategy pool, the state, the data, the checkpointer and the
  controllers; `run()` trains to `train.num_steps`, holding the run dir's lock (`lock`, taken
  by the caller with `take_run_dir`, or by `run` itself). A context manager (closes the
  checkpointer on exit)."""

  def __init__(self, cfg: Config, devices=None, lock: RunDirLock | None = None,
               skip_if_finished: bool = False):
    """`devices`: the devices of the mesh (default: all of them, over all processes).
    `skip_if_finished`: when the run dir's latest checkpoint is at or past train.num_steps,
    build nothing (no compiling); `run` then returns at once."""
    self.lock = lock
    self.checkpointer: Checkpointer | None = None
    try:
      train_tokens, val_tokens, data_vocab = data_lib.load_tokens(cfg.validate().data)
      cfg = data_lib.resolve_vocab(cfg, data_vocab).validate()
      if (note := data_lib.byte_corpus_mismatch(cfg)) and jax.process_index() == 0:
        log.warning("warning: %s", note)
      self.checkpointer = Checkpointer(cfg.train.run_dir, cfg.checkpoint)
      self.cfg = cfg = self._check_run_dir(cfg)   # before compiling anything
      if not skip_if_finished:
        self.finished_step = None
      if self.finished_step is None:
        self._build(cfg, devices, train_tokens, val_tokens)
    except BaseException:
      with contextlib.suppress(Exception):   # keep the error that is on its way out
        self.close()
      raise

  def _check_run_dir(self, cfg: Config) -> Config:
    """The run dir against this config: a checkpoint of another model stops the run, a start
    at step 0 over an earlier run's record is refused (unless train.restart), and the
    learning-rate horizon is the saved one unless the config sets it."""
    saved = self.checkpointer.latest_meta()
    vocab_fixed = {}
    if data_lib.declared_vocab(cfg.data) is not None and cfg.data.path is not None:
      vocab_fixed["model.vocab_size"] = f"the vocabulary of data.path={cfg.data.path!r}"
    self.checkpointer.check_model(model_fields(cfg), vocab_fixed)
    self.aside: str | None = None   # an earlier run to move aside before this one writes
    if self.checkpointer.latest_step() is None:
      earlier = history_lib.earlier_run(cfg.train.run_dir, cfg.checkpoint.every)
      if earlier and not cfg.train.restart:
        raise history_lib.refuse_fresh_start(cfg.train.run_dir, earlier)
      self.aside = earlier
      unsaved = history_lib.unsaved_start(cfg.train.run_dir, cfg.checkpoint.every)
      if unsaved and not earlier and jax.process_index() == 0:
        log.info("%s", unsaved)
    decay, self.schedule_note = history_lib.decay_steps(cfg, saved)
    # Nothing to train: `run` says so at once, without building (compiling) anything.
    self.finished_step = saved["step"] if saved and saved["step"] >= cfg.train.num_steps \
        else None
    if saved and self.finished_step is None and jax.process_index() == 0:
      log.info("resuming from step %d of %s", saved["step"], self.checkpointer.directory)
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=decay))

  def _build(self, cfg: Config, devices, train_tokens, val_tokens) -> None:
    devices = list(jax.devices() if devices is None else devices)
    self.lr = schedule(cfg.optim, cfg.optim.decay_steps)
    self.tx = optimizer(cfg.optim, cfg.optim.decay_steps)
    self.pool = StrategyPool(cfg, self.tx, self.lr, devices)
    self.is_main = jax.process_index() == 0
    prog = self.pool.program
    rows = data_lib.process_rows(prog.batch_sharding, cfg.data.global_batch_size,
                                 cfg.data.seq_len + 1)   # only this process's rows are read
    loader_args = dict(seq_len=cfg.data.seq_len, global_batch_size=cfg.data.global_batch_size,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       rows=rows)
    self.loader = data_lib.BatchLoader(train_tokens, seed=cfg.data.seed, **loader_args)
    self.val_loader = data_lib.BatchLoader(val_tokens, seed=cfg.data.seed + 1, **loader_args)
    self.trace: TraceRecorder | None = None
    self.guard = faults.NonFiniteGuard(cfg.train.max_consecutive_nonfinite)
    self.restore_warnings: list[str] = []
    self.state = init_state(prog.model, self.tx, prog.shardings, prog.layout,
                            cfg.data.global_batch_size, cfg.data.seq_len, cfg.train.seed)
    self.checkpointer.needed_bytes = sum(x.nbytes for x in jax.tree.leaves(self.state))
    self.writer: metrics_lib.JsonlWriter | None = None   # open while `run` runs
    self.layouts = layouts = LayoutReplanning(cfg.planner.lag)
    self.controllers: list[Hook] = [layouts]
    if self.pool.switching:   # afterwards a switch or a re-plan compiles nothing
      self.pool.warm_up(self.state)
      self.controllers.insert(0, StrategySwitching(self.cfg, self.pool, layouts))

  def __enter__(self) -> Trainer:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    if exc_type is None:
      self.close()
      return
    with contextlib.suppress(Exception):   # keep the error that is on its way out
      self.close()

  def close(self) -> None:
    try:
      if self.checkpointer is not None:
        self.checkpointer.close()
    finally:
      if self.lock is not None:
        self.lock.release()

  def maybe_restore(self) -> int:
    """Resumes from the latest intact checkpoint of the run dir, whatever mesh or expert mode
    it was saved under; returns the starting step."""
    restored = self.checkpointer.restore(self.state, self.pool.layout,
                                         self.pool.program.expert_mode)
    if restored is None:
      return 0
    meta = restored.meta
    self.state = self.pool.program.canonical_state(restored.state, back=True)
    self.pool.set_layout(self.pool.active, restored.layout)
    self.restore_warnings = restored.warnings
    self.loader.position = int(meta["data_position"])
    planner_state = meta.get("planner", {})
    history = planner_state.get("history", [])
    if history and len(history[0][0]) != self.pool.program.mesh.shape["expert"]:
      planner_state = {}   # loads of another expert-axis size: start the statistics afresh
      self.restore_warnings.append("planner statistics were saved on another expert-axis size; "
                                   "they start afresh")
    self.pool.planner.load_state_dict(planner_state)
    self.layouts.load_state_dict(planner_state.get("pending", []))   # re-plans not yet applied
    self.restore_warnings += history_lib.training_changes(
        meta, self.cfg, f"checkpoint {self.checkpointer.directory}/{restored.step}",
        restored.step)
    if self.schedule_note:
      self.restore_warnings.append(self.schedule_note)
    self.guard.load_state_dict(meta.get("nonfinite", {}))
    self.state = self.pool.load_state_dict(meta.get("strategy") or {}, self.state)
    if self.is_main:
      for w in self.restore_warnings:
        log.warning("warning: %s", w)
    return restored.step

  def init_weights(self) -> None:
    """`train.init_from`: that run dir's latest weights and their routing bias (a converted
    DeepSeek-V3's chooses experts with it), in this run's strategy and layout; the optimizer
    state and the step stay those of a fresh run."""
    cfg = self.cfg
    source = Checkpointer(cfg.train.init_from, cfg.checkpoint)
    try:
      source.check_model(model_fields(cfg))
      restored = source.restore_weights(self.state, self.pool.layout,
                                        self.pool.program.expert_mode)
    finally:
      source.close()
    state = self.state.replace(params=restored.state.params,
                               router_bias_LxE=restored.state.router_bias_LxE)
    self.state = self.pool.program.canonical_state(state, back=True)
    self.pool.set_layout(self.pool.active, restored.layout)
    if self.is_main:
      log.info("weights from %s (step %d)", source.directory, restored.step)
      for w in restored.warnings:
        log.warning("warning: %s", w)

  def save(self, step: int) -> None:
    """With a pool, the checkpoint holds member 0's form of the state (an exact move), the
    active member and every member's layout, so a resume lands on the same member."""
    planner = {**self.pool.planner.state_dict(), "pending": self.layouts.state_dict()}
    meta = {"data_position": self.loader.position, "planner": planner,
            "nonfinite": self.guard.state_dict(), "model": model_fields(self.cfg),
            "training": history_lib.training_fields(self.cfg)}
    if self.pool.switching:
      meta["strategy"] = self.pool.state_dict()
    self._check_lock()
    self._write_trace()   # first: the trace then always reaches the latest checkpoint
    state, layout, expert_mode = self.pool.saved_form(self.state)
    self.checkpointer.save(step, state, layout, meta, expert_mode)

  def _write_trace(self) -> None:
    if self.trace is not None:
      self._check_lock()
      with self.checkpointer.writing("the routing trace", self.trace.path):
        self.trace.write()

  def _check_lock(self) -> None:
    """Only the lock's holder writes: a run whose lock was taken over (train.force_unlock
    elsewhere) stops before its next checkpoint or trace. (Its metrics lines go to the file it
    opened, which the new holder's resume has already replaced by a new one.)"""
    if self.is_main and self.lock is not None and not self.lock.held():
      raise RunDirBusy(f"the lock {self.lock.path} no longer names this run (another run took "
                       "it over with train.force_unlock); stopped without saving, the other "
                       "run owns the run dir now.")

  def evaluate(self) -> float:
    prog, losses = self.pool.program, []
    layout = step_lib.biased_layout(prog.layout, self.state.router_bias_LxE)   # routes as trained
    for i in range(self.cfg.train.eval_batches):
      batch = data_lib.make_global_batch(self.val_loader.batch_at(i), prog.batch_sharding,
                                         self.cfg.data.global_batch_size)
      losses.append(prog.eval_step(self.state.params, batch, layout))
    return float(np.mean([float(x) for x in losses]))

  def run(self, hooks: list[Hook] = (), stop: preempt.StopRequest | None = None,
          run_files: dict[str, str] | None = None) -> dict:
    """Trains to train.num_steps. `hooks` (see `moejax.train.controllers`) run before the
    controllers, around every step (schedules, load injection in benchmarks). On SIGTERM or
    SIGINT (`stop`, entered by the caller, e.g. train.py from its start; default: handlers for
    this call) every process finishes the same step, saves it and returns. `run_files`:
    {name: text} written into the run dir once it is known to be this run's (e.g. the
    operative gin config)."""
    if self.finished_step is not None:
      return {"start_step": self.finished_step, "first": None, "last": None, "preempted": None,
              "saved_step": self.finished_step, "checkpoint_dir": self.checkpointer.directory,
              "decay_steps": self.cfg.optim.decay_steps, "balance": None}
    if self.lock is not None:
      return self._run(hooks, stop, run_files or {})
    self.lock = take_run_dir(self.cfg)
    try:
      return self._run(hooks, stop, run_files or {})
    finally:
      self.lock.release()
      self.lock = None

  def _run(self, hooks, stop, run_files: dict[str, str]) -> dict:
    cfg = self.cfg
    if cfg.train.init_from and os.path.abspath(cfg.train.init_from) == os.path.abspath(
        cfg.train.run_dir):
      raise ConfigError(f"train.init_from={cfg.train.init_from!r} is train.run_dir itself; "
                        "give the new run its own train.run_dir.")
    if self.aside and self.is_main:   # train.restart: the earlier run's files, kept
      moved = history_lib.move_aside(cfg.train.run_dir)
      if moved:
        log.warning("warning: train.restart: moved the earlier run's files (%s) into %s",
                    self.aside, moved)
    start = self.maybe_restore()   # before any file of the run dir is written
    if cfg.train.init_from and self.checkpointer.latest_step() is None:
      self.init_weights()
    self._write_run_files(run_files, start)
    if cfg.trace.path and self.is_main:
      self.trace = TraceRecorder(cfg.trace.path, cfg.moe.top_k, start)
      if self.trace.warning:
        log.warning("warning: %s", self.trace.warning)
        self.restore_warnings.append(self.trace.warning)
    self.writer = metrics_lib.JsonlWriter(os.path.join(cfg.train.run_dir, "metrics.jsonl"),
                                          enabled=self.is_main, start=start,
                                          guard=self.checkpointer.writing)
    for w in self.lock.warnings:
      self.writer.write({"step": start, "event": "run_dir_warning", "message": w})
    for w in self.restore_warnings:
      self.writer.write({"step": start, "event": "checkpoint_warning", "message": w})
    bar = tqdm(total=cfg.train.num_steps, initial=start,
               disable=not (self.is_main and cfg.train.progress_bar), dynamic_ncols=True)
    rate = metrics_lib.TokenRate(cfg.data.global_batch_size * cfg.data.seq_len)
    balance = BalanceTally(from_step=start + (cfg.train.num_steps - start) // 2)
    hooks = [*hooks, *self.controllers, balance,
             *tensorboard_hooks(cfg.train.tensorboard, self.is_main, cfg.train.run_dir, start)]
    first = last = pending = None
    done = start

    def log_pending():   # reads step N-1's metrics, after step N was dispatched
      nonlocal first, last, pending
      last = self._log(bar, rate, hooks, *pending)
      first, pending = first or last, None

    with contextlib.ExitStack() as stack:
      for hook in hooks:
        stack.callback(hook.close)
      if stop is None:
        stop = stack.enter_context(preempt.StopRequest())
      for step in range(start, cfg.train.num_steps):
        if any([hook.before_step(self, step) for hook in hooks]):
          rate.reset()   # keep switch and migration time out of tokens/s
        prog = self.pool.program
        batch = data_lib.make_global_batch(self.loader.next_local(), prog.batch_sharding,
                                           cfg.data.global_batch_size)
        self.state, m = prog.train_step(self.state, batch, prog.layout)
        if pending is not None:
          log_pending()
        pending = (step, m, self.pool.active)
        done = step + 1
        stopping = stop.poll(prog.mesh)   # SIGTERM/SIGINT: the same step on every process
        # An eval that is due runs even when stopping: the resumed run starts after it.
        eval_now = done % cfg.train.eval_every == 0 or done == cfg.train.num_steps
        save_now = not stopping and done % cfg.checkpoint.every == 0 and (
            done != cfg.train.num_steps)
        # Read this step's metrics now: with planner.fresh the next step is planned on them;
        # before an eval or a save its record is written first, so a kill then loses nothing.
        if cfg.planner.fresh or eval_now or save_now:
          log_pending()
        if eval_now:   # evaluated after step `step` finished (= at checkpoint `done`)
          self.writer.write({"step": step, "eval_loss": (eval_loss := self.evaluate())})
          for hook in hooks:
            hook.after_eval(self, step, eval_loss)
        if save_now:
          self.save(done)
        if eval_now or save_now:
          rate.reset()   # keep eval and checkpoint time out of tokens/s
        if stopping:
          break
      if pending is not None:
        log_pending()
      if self.checkpointer.latest_step() != done:   # the end, or the step reached when stopped
        self.save(done)
      self._write_trace()
      self.checkpointer.wait()
    return {**self._finish(start, first, last, done, stop, bar), "balance": balance.summary()}

  def _write_run_files(self, run_files: dict[str, str], start: int) -> None:
    """`run_files`, config.json and memory.txt (moejax.train.run_files), with a copy of each
    but memory.txt named after the start step: what every start ran with."""
    os.makedirs(self.cfg.train.run_dir, exist_ok=True)
    if not self.is_main:
      return
    files = run_files_lib.texts(self.cfg, self.pool.programs, self.pool.program,
                                run_files, start)
    for name, text in files.items():
      path = os.path.join(self.cfg.train.run_dir, name)
      with self.checkpointer.writing(name, path):
        metrics_lib.replace_file(path, text)

  def _finish(self, start, first, last, done, stop, bar) -> dict:
    preempted = stop.signal_name if done < self.cfg.train.num_steps else None
    if preempted:
      self.writer.write({"step": done - 1, "event": "preempted", "signal": preempted,
                         "checkpoint_step": done})
    bar.close()
    self.writer.close()
    return {"start_step": start, "first": first, "last": last, "preempted": preempted,
            "saved_step": done, "checkpoint_dir": self.checkpointer.directory,
            "decay_steps": self.cfg.optim.decay_steps}

  def _log(self, bar, rate, hooks, step, m, member) -> dict:
    """Reads and records `step`'s metrics; `member` is the pool member that ran it (the one
    before a switch, for the step still in flight when the switch happened)."""
    m = jax.device_get(m)   # blocks until `step` has finished
    prog = self.pool.programs[member]
    tokens_per_s = rate.tick()
    counts_LxWxE = m["counts_LxWxE"]
    if self.trace is not None:
      self.trace.add(step, counts_LxWxE, prog.mesh.shape["expert"])
    record = {
        "step": step, "loss": float(m["loss"]), "ce": float(m["ce"]),
        "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]), "tokens_per_s": tokens_per_s,
        "skipped": bool(m["skipped"]), **({"mtp_ce": float(m["mtp_ce"])} if "mtp_ce" in m else {}),
        "moe": metrics_lib.moe_layer_records(m, prog.mesh.shape["expert"]),
        "strategy": prog.strategy.spec,
    }
    for hook in hooks:
      hook.after_metrics(self, step, record, counts_LxWxE, member)
    stop = self.guard.observe(step, record["skipped"])
    if record["skipped"]:
      record.update(nonfinite_consecutive=self.guard.consecutive, nonfinite_total=self.guard.total)
    self.writer.write(record)
    if stop:
      latest = self.checkpointer.latest_step()
      raise self.guard.error(step, "none" if latest is None else
                             f"step {latest} in {self.checkpointer.directory}")
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tokens_per_s or 0:.0f}")
    bar.update(step + 1 - bar.n)
    return record


def train(cfg: Config, devices=None, stop: preempt.StopRequest | None = None,
          run_files: dict[str, str] | None = None) -> dict:
  """Takes the run dir, builds the trainer and trains (`Trainer.run`)."""
  lock = take_run_dir(cfg)
  try:
    trainer = Trainer(cfg, devices, lock=lock, skip_if_finished=True)
  except BaseException:
    lock.release()   # Trainer releases it too once built; a second release does nothing
    raise
  with trainer:
    return trainer.run(stop=stop, run_files=run_files)
