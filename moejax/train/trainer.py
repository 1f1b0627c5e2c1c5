"""The training loop: build everything from a Config, resume, train, evaluate, save."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from moejax.config import Config, ConfigError, batch_split_error
from moejax.layout.migrate import migrate
from moejax.layout.tables import Layout, from_placements, from_slot_expert, to_placements
from moejax.placement.replanner import OnlinePlanner
from moejax.placement.trace import TraceRecorder
from moejax.strategy import memory
from moejax.strategy.cost import load_dispersion, load_profile
from moejax.strategy.offline import workload_of
from moejax.strategy.spec import check_pool, from_config, parse
from moejax.strategy.switcher import StrategySwitcher, expert_shares
from moejax.train import data as data_lib, faults, metrics as metrics_lib, preempt
from moejax.train.checkpoint import Checkpointer
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import build_program, initial_layout, warm_up_pool
from moejax.train.state import init_state

__all__ = ["Trainer", "initial_layout", "train"]

log = logging.getLogger("moejax")


def _dense_capacity(moe) -> float | None:
  """The capacity factor the dense dispatch enforces (None: ragged, dropless)."""
  return None if moe.dispatch == "ragged" else moe.capacity_factor


def _check_batch(cfg: Config, shards: int) -> None:
  b = cfg.data.global_batch_size
  if why := batch_split_error(b, shards, "data.global_batch_size"):
    raise ConfigError(why + ".")
  if b % jax.process_count():
    raise ConfigError(f"data.global_batch_size={b} is not divisible by the "
                      f"{jax.process_count()} processes.")


class Trainer:
  """Holds the built pieces of one run; `run()` trains to `train.num_steps`."""

  def __init__(self, cfg: Config, devices=None):
    """`devices`: the devices of the mesh (default: all of them, over all processes)."""
    self.cfg = cfg.validate()
    devices = list(jax.devices() if devices is None else devices)
    self.lr = schedule(cfg.optim, cfg.train.num_steps)
    self.tx = optimizer(cfg.optim, cfg.train.num_steps)
    # One program per strategy: the pool (compiled ahead of time), or the config's own.
    strategies = [parse(spec) for spec in cfg.strategy.pool]
    if strategies:
      check_pool(strategies, cfg, len(devices))
    else:
      strategies = [from_config(cfg, len(devices))]
    for s in strategies:
      _check_batch(cfg, s.data * s.expert)
    aot = len(strategies) > 1
    self.programs = [build_program(cfg, s, self.tx, self.lr, devices, compile_now=aot)
                     for s in strategies]
    self.active = 0
    train_tokens, val_tokens, min_vocab = data_lib.load_tokens(cfg.data)
    if min_vocab > cfg.model.vocab_size:
      raise ConfigError(f"the data has token ids up to {min_vocab - 1} but model.vocab_size="
                        f"{cfg.model.vocab_size}; set model.vocab_size >= {min_vocab}.")
    self.is_main = jax.process_index() == 0
    rows = data_lib.process_rows(self.batch_sharding, cfg.data.global_batch_size,
                                 cfg.data.seq_len + 1)   # only this process's rows are read
    loader_args = dict(seq_len=cfg.data.seq_len, global_batch_size=cfg.data.global_batch_size,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       rows=rows)
    self.loader = data_lib.BatchLoader(train_tokens, seed=cfg.data.seed, **loader_args)
    self.val_loader = data_lib.BatchLoader(val_tokens, seed=cfg.data.seed + 1, **loader_args)
    b, length = cfg.data.global_batch_size, cfg.data.seq_len
    self.planners = [OnlinePlanner(p.cfg.planner, p.mesh.shape["expert"],
                                   capacity_factor=_dense_capacity(p.cfg.moe))
                     for p in self.programs]
    self.trace: TraceRecorder | None = None
    self.guard = faults.NonFiniteGuard(cfg.train.max_consecutive_nonfinite)
    self.checkpointer = Checkpointer(cfg.train.run_dir, cfg.checkpoint)
    self.restore_warnings: list[str] = []
    self.state = init_state(self.model, self.tx, self.shardings, self.layout, b, length,
                            cfg.train.seed)
    self.transfers: dict = {}
    self.switch_cost_s: dict = {}
    self.switcher = None
    # Finished steps of the active member: (counts [L, S, E], dropped share of choices).
    self._recent = collections.deque(maxlen=cfg.planner.window)
    self.last_counts: np.ndarray | None = None   # [L, S, E] of the latest finished step
    if aot:
      self._warm_up_switching(strategies)

  # The active program's pieces (one strategy = one compiled program).
  program = property(lambda self: self.programs[self.active])
  mesh = property(lambda self: self.program.mesh)
  model = property(lambda self: self.program.model)
  shardings = property(lambda self: self.program.shardings)
  batch_sharding = property(lambda self: self.program.batch_sharding)
  layout_sharding = property(lambda self: self.program.layout_sharding)
  train_step = property(lambda self: self.program.train_step)
  eval_step = property(lambda self: self.program.eval_step)
  planner = property(lambda self: self.planners[self.active])
  moe_cfg = property(lambda self: self.program.cfg.moe)

  @property
  def layout(self) -> Layout:
    return self.program.layout

  @layout.setter
  def layout(self, value: Layout) -> None:
    self.program.layout = value

  def _warm_up_switching(self, strategies) -> None:
    """Compiles, times and runs once every state move and member step (`warm_up_pool`), so
    switching later compiles nothing; then the online stage."""
    self.transfers, self.switch_cost_s = warm_up_pool(
        self.programs, self.state, self.tx, [p.active for p in self.planners])
    self.switcher = StrategySwitcher(self.cfg.strategy, strategies, workload_of(self.cfg),
                                     load_profile(self.cfg.strategy.profile))

  def _to_member(self, target: int) -> None:
    self.state = self.transfers[(self.active, target)](self.state)
    self.active = target

  def maybe_switch_strategy(self, step: int, writer) -> None:
    """Online stage: every strategy.every steps, move to the pool member predicted best."""
    if self.switcher is None or not self.switcher.due(step) or not self._recent:
      return
    counts = np.stack([c for c, _ in self._recent])
    dropped = float(np.mean([d for _, d in self._recent]))
    decision = self.switcher.decide(self.active, expert_shares(counts), self.switch_cost_s,
                                    dropped, load_dispersion(counts))
    if decision is None:
      return
    jax.block_until_ready(self.state)   # time the switch alone, not the step in flight
    tick = time.perf_counter()
    src = self.active
    self._to_member(decision.target)
    jax.block_until_ready(self.state)
    writer.write({"step": step, "event": "strategy_switch",
                  "from": self.programs[src].strategy.spec, "to": self.program.strategy.spec,
                  "reason": decision.reason, "predicted_s": list(decision.predicted_s),
                  "predicted_drop": list(decision.predicted_drop),
                  "predicted_gain_s": decision.gain_s,
                  "switch_cost_s": decision.switch_cost_s,
                  "seconds": time.perf_counter() - tick})
    self._recent.clear()
    self._reads.clear()   # keep switch time out of tokens/s
    if self.planner.active:   # the member was idle: its re-planner gets this load and re-plans
      self.planner.history.clear()   # now, so fsep replicas follow the load from the first step
      for step_counts in counts:
        self.planner.observe(step_counts)
      self.maybe_switch_layout(step, writer, now=True)

  def maybe_restore(self) -> int:
    """Resumes from the latest intact checkpoint of the run dir, whatever mesh or expert mode
    it was saved under; returns the starting step."""
    restored = self.checkpointer.restore(self.state, self.layout, self.moe_cfg.expert_mode)
    if restored is None:
      return 0
    self.state, self.layout, meta = restored.state, restored.layout, restored.meta
    self.restore_warnings = restored.warnings
    self.loader.position = int(meta["data_position"])
    planner_state = meta.get("planner", {})
    history = planner_state.get("history", [])
    if history and len(history[0][0]) != self.mesh.shape["expert"]:
      planner_state = {}   # loads of another expert-axis size: start the statistics afresh
      self.restore_warnings.append("planner statistics were saved on another expert-axis size; "
                                   "they start afresh")
    self.planner.load_state_dict(planner_state)
    self.guard.load_state_dict(meta.get("nonfinite", {}))
    pool_meta = meta.get("strategy")
    if pool_meta and self.transfers and pool_meta.get("pool") == [
        p.strategy.spec for p in self.programs]:
      for prog, saved in zip(self.programs[1:], pool_meta["layouts"][1:]):
        prog.layout = jax.device_put(
            Layout(**{k: np.asarray(v, dtype=np.asarray(getattr(prog.layout, k)).dtype)
                      for k, v in saved.items()}), prog.layout_sharding)
      if pool_meta["active"]:
        self._to_member(int(pool_meta["active"]))
    if self.is_main:
      for w in self.restore_warnings:
        log.warning("warning: %s", w)
    return restored.step

  def save(self, step: int) -> None:
    """With a pool, the checkpoint holds member 0's form of the state (an exact move), the
    active member and every member's layout, so a resume lands on the same member."""
    meta = {"data_position": self.loader.position, "planner": self.planner.state_dict(),
            "nonfinite": self.guard.state_dict()}
    state, active = self.state, self.active
    if self.transfers:
      meta["strategy"] = {"pool": [p.strategy.spec for p in self.programs], "active": active,
                          "layouts": [{k: np.asarray(v).tolist() for k, v in
                                       vars(p.layout).items()} for p in self.programs]}
      if active:
        state = self.transfers[(active, 0)](state)
    self.active = 0
    try:
      self.checkpointer.save(step, state, self.layout, meta, self.moe_cfg.expert_mode)
    finally:
      self.active = active
    if self.trace is not None:
      self.trace.write()

  def maybe_switch_layout(self, step: int, writer, now: bool = False) -> None:
    """dyn.X: before dispatching `step`, re-plan from the finished steps' loads (`now`: even
    off the period, right after a strategy switch)."""
    if not (now or self.planner.due(step)):
      return
    n, num_experts = self.mesh.shape["expert"], self.moe_cfg.num_experts
    new, switches = self.planner.propose(to_placements(self.layout, n))
    if not switches:
      return
    jax.block_until_ready(self.state)   # time the switch alone, not the step in flight
    tick = time.perf_counter()
    bias = self.layout.router_bias_LxE
    if self.moe_cfg.expert_mode == "ep":  # slots own weights: move them and their Adam state
      new_layout = jax.device_put(
          from_slot_expert(np.stack([p.slot_expert for p in new]), num_experts).replace(
              router_bias_LxE=bias), self.layout_sharding)
      self.state = migrate(self.state, self.layout, new_layout)
    else:                                 # fsep: the next step restores the new slots
      new_layout = jax.device_put(from_placements(new, num_experts, n).replace(
          router_bias_LxE=bias), self.layout_sharding)
    jax.block_until_ready((self.state, new_layout))
    seconds = time.perf_counter() - tick
    self.layout = new_layout
    for sw in switches:
      writer.write({"step": step, "event": "layout_switch", "layer": sw.layer,
                    "policy": self.program.cfg.planner.policy,
                    "predicted_gain": sw.predicted_before - sw.predicted_after,
                    "predicted_before": sw.predicted_before,
                    "predicted_after": sw.predicted_after,
                    "migration_s": seconds, "experts_moved": sw.experts_moved})
    self._reads.clear()   # keep migration time out of tokens/s

  def evaluate(self) -> float:
    losses = []
    for i in range(self.cfg.train.eval_batches):
      batch = data_lib.make_global_batch(self.val_loader.batch_at(i), self.batch_sharding,
                                         self.cfg.data.global_batch_size)
      losses.append(self.eval_step(self.state.params, batch, self.layout))
    return float(np.mean([float(x) for x in losses]))

  def _record(self, step: int, m: dict, tokens_per_s: float, prog) -> dict:
    return {
        "step": step, "loss": float(m["loss"]), "ce": float(m["ce"]),
        "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]), "tokens_per_s": tokens_per_s,
        "skipped": bool(m["skipped"]),
        "moe": metrics_lib.moe_layer_records(m, prog.mesh.shape["expert"]),
        "strategy": prog.strategy.spec,
    }

  def run(self, before_step=None, stop: preempt.StopRequest | None = None) -> dict:
    """Trains to train.num_steps. `before_step(trainer, step)`, if given, runs on the host
    before each step is dispatched (schedules, load injection in benchmarks). On SIGTERM or
    SIGINT (`stop`, entered by the caller, e.g. train.py from its start; default: handlers for
    this call) every process finishes the same step, saves it and returns."""
    cfg = self.cfg
    os.makedirs(cfg.train.run_dir, exist_ok=True)
    if self.is_main:
      with open(os.path.join(cfg.train.run_dir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
      with open(os.path.join(cfg.train.run_dir, "memory.txt"), "w") as f:
        f.write(memory.report(
            cfg.model.num_layers // cfg.moe.moe_every, cfg.moe.num_experts, cfg.model.d_model,
            cfg.moe.d_ff, self.mesh.shape["expert"], self.mesh.shape["model"],
            self.moe_cfg.slots_per_device or None) + "\n")
    start = self.maybe_restore()
    if cfg.trace.path and self.is_main:
      self.trace = TraceRecorder(cfg.trace.path, cfg.moe.top_k, start)
    writer = metrics_lib.JsonlWriter(os.path.join(cfg.train.run_dir, "metrics.jsonl"),
                                     enabled=self.is_main, start=start)
    for w in self.restore_warnings:
      writer.write({"step": start, "event": "checkpoint_warning", "message": w})
    bar = tqdm(total=cfg.train.num_steps, initial=start,
               disable=not (self.is_main and cfg.train.progress_bar), dynamic_ncols=True)
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    first = last = None
    pending = None
    done = start
    self._reads = collections.deque(maxlen=11)   # times at which step metrics became ready
    with contextlib.ExitStack() as stack:
      if stop is None:
        stop = stack.enter_context(preempt.StopRequest())
      for step in range(start, cfg.train.num_steps):
        if before_step is not None:
          before_step(self, step)
        self.maybe_switch_strategy(step, writer)
        self.maybe_switch_layout(step, writer)
        batch = data_lib.make_global_batch(self.loader.next_local(), self.batch_sharding,
                                           cfg.data.global_batch_size)
        self.state, m = self.train_step(self.state, batch, self.layout)
        if pending is not None:   # read step N-1's metrics after dispatching step N
          last = self._log(writer, bar, *pending, tokens_per_step)
          first = first or last
        pending = (step, m, self.active)
        done = step + 1
        stopping = stop.poll(self.mesh)   # SIGTERM/SIGINT: the same step on every process
        eval_now = not stopping and (done % cfg.train.eval_every == 0 or
                                     done == cfg.train.num_steps)
        save_now = not stopping and done % cfg.checkpoint.every == 0 and (
            done != cfg.train.num_steps)
        # Read this step's metrics now: with planner.fresh the next step is planned on them;
        # before an eval or a save its record is written first, so a kill then loses nothing.
        if cfg.planner.fresh or eval_now or save_now:
          last = self._log(writer, bar, *pending, tokens_per_step)
          first = first or last
          pending = None
        if eval_now or save_now:
          if eval_now:   # evaluated after step `step` finished (= at checkpoint `done`)
            writer.write({"step": step, "eval_loss": self.evaluate()})
          if save_now:
            self.save(done)
          self._reads.clear()   # keep eval and checkpoint time out of tokens/s
        if stopping:
          break
      if pending is not None:
        last = self._log(writer, bar, *pending, tokens_per_step)
      if self.checkpointer.latest_step() != done:   # the end, or the step reached when stopped
        self.save(done)
      if self.trace is not None:
        self.trace.write()
      self.checkpointer.wait()
    preempted = stop.signal_name if done < cfg.train.num_steps else None
    if preempted:
      writer.write({"step": done - 1, "event": "preempted", "signal": preempted,
                    "checkpoint_step": done})
    bar.close()
    writer.close()
    return {"start_step": start, "first": first, "last": last, "preempted": preempted,
            "saved_step": done, "checkpoint_dir": self.checkpointer.directory}

  def _log(self, writer, bar, step, m, member, tokens_per_step) -> dict:
    """Reads and records `step`'s metrics; `member` is the pool member that ran it (the one
    before a switch, for the step still in flight when the switch happened)."""
    m = jax.device_get(m)   # blocks until `step` has finished
    prog = self.programs[member]
    self._reads.append(time.perf_counter())
    span = self._reads[-1] - self._reads[0]
    rate = tokens_per_step * (len(self._reads) - 1) / span if span > 0 else None
    self.planners[member].observe(m["counts_LxSxE"])
    self.last_counts = m["counts_LxSxE"]   # for host-side controllers run in before_step
    if self.trace is not None:
      self.trace.add(step, m["counts_LxSxE"], prog.mesh.shape["expert"])
    record = self._record(step, m, rate, prog)
    if member == self.active:   # the online stage judges the member now running
      self._recent.append((m["counts_LxSxE"],
                           np.mean([r["dropped_fraction"] for r in record["moe"]])))
    stop = self.guard.observe(step, record["skipped"])
    if record["skipped"]:
      record.update(nonfinite_consecutive=self.guard.consecutive, nonfinite_total=self.guard.total)
    writer.write(record)
    if stop:
      latest = self.checkpointer.latest_step()
      raise self.guard.error(step, "none" if latest is None else
                             f"step {latest} in {self.checkpointer.directory}")
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate or 0:.0f}")
    bar.update(step + 1 - bar.n)
    return record


def train(cfg: Config, devices=None, stop: preempt.StopRequest | None = None) -> dict:
  trainer = Trainer(cfg, devices)
  try:
    return trainer.run(stop=stop)
  finally:
    trainer.checkpointer.close()
