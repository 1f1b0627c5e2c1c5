"""The training loop: build everything from a Config, resume, train, evaluate, save."""

from __future__ import annotations

import collections
import functools
import json
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from moejax import data as data_lib, memory, metrics as metrics_lib, step as step_lib
from moejax.checkpoint import Checkpointer
from moejax.config import Config, ConfigError, MoEConfig
from moejax.layout import (
  Layout,
  default_fsep_slots,
  from_placements,
  from_slot_expert,
  round_robin_layout,
  static_layout,
  to_placements,
)
from moejax.mesh import batch_sharding, build_mesh, num_batch_shards, replicated
from moejax.migrate import migrate
from moejax.model import Transformer
from moejax.online import OnlinePlanner
from moejax.optim import optimizer, schedule
from moejax.state import init_state, state_shardings
from moejax.trace import TraceRecorder


def initial_layout(moe: MoEConfig, num_layers: int, num_devices: int) -> Layout:
  """ep: expert e on device e // (E/N); fsep: C slots per device, round-robin replicas."""
  if moe.expert_mode == "ep":
    return static_layout(num_layers, moe.num_experts, num_devices)
  slots = moe.slots_per_device or default_fsep_slots(moe.num_experts, num_devices)
  return round_robin_layout(num_layers, moe.num_experts, num_devices, slots)


def _check_batch(cfg: Config, shards: int) -> None:
  b = cfg.data.global_batch_size
  if b % shards:
    raise ConfigError(f"data.global_batch_size={b} is not divisible by data*expert={shards} "
                      f"devices; use a multiple of {shards}.")
  if b % jax.process_count():
    raise ConfigError(f"data.global_batch_size={b} is not divisible by the "
                      f"{jax.process_count()} processes.")


class Trainer:
  """Holds the built pieces of one run; `run()` trains to `train.num_steps`."""

  def __init__(self, cfg: Config):
    self.cfg = cfg.validate()
    self.mesh = build_mesh(cfg.mesh)
    _check_batch(cfg, num_batch_shards(self.mesh))
    train_tokens, val_tokens, min_vocab = data_lib.load_tokens(cfg.data)
    if min_vocab > cfg.model.vocab_size:
      raise ConfigError(f"the data has token ids up to {min_vocab - 1} but model.vocab_size="
                        f"{cfg.model.vocab_size}; set model.vocab_size >= {min_vocab}.")
    self.is_main = jax.process_index() == 0
    loader_args = dict(seq_len=cfg.data.seq_len, global_batch_size=cfg.data.global_batch_size,
                       process_index=jax.process_index(), process_count=jax.process_count())
    self.loader = data_lib.BatchLoader(train_tokens, seed=cfg.data.seed, **loader_args)
    self.val_loader = data_lib.BatchLoader(val_tokens, seed=cfg.data.seed + 1, **loader_args)

    self.model = Transformer(cfg.model, cfg.moe, self.mesh)
    num_moe_layers = cfg.model.num_layers // cfg.moe.moe_every
    self.layout: Layout = jax.device_put(
        initial_layout(cfg.moe, num_moe_layers, self.mesh.shape["expert"]), replicated(self.mesh))
    self.lr = schedule(cfg.optim, cfg.train.num_steps)
    self.tx = optimizer(cfg.optim, cfg.train.num_steps)
    b, length = cfg.data.global_batch_size, cfg.data.seq_len
    self.shardings = state_shardings(self.model, self.tx, self.mesh, self.layout, b, length)
    self.batch_sharding = batch_sharding(self.mesh)
    layout_sh = replicated(self.mesh)
    self.train_step = jax.jit(
        functools.partial(step_lib.train_step, model=self.model, tx=self.tx, moe_cfg=cfg.moe,
                          lr_schedule=self.lr),
        in_shardings=(self.shardings, self.batch_sharding, layout_sh),
        out_shardings=(self.shardings, layout_sh), donate_argnums=0)   # metrics replicated
    self.eval_step = jax.jit(
        functools.partial(step_lib.eval_step, model=self.model, moe_cfg=cfg.moe),
        in_shardings=(self.shardings.params, self.batch_sharding, layout_sh))
    self.layout_sharding = layout_sh
    self.planner = OnlinePlanner(cfg.planner, self.mesh.shape["expert"])
    self.trace: TraceRecorder | None = None
    self.checkpointer = Checkpointer(cfg.train.run_dir, cfg.checkpoint)
    self.state = init_state(self.model, self.tx, self.shardings, self.layout, b, length,
                            cfg.train.seed)

  def maybe_restore(self) -> int:
    """Resumes from the latest checkpoint of the run dir; returns the starting step."""
    if self.checkpointer.latest_step() is None:
      return 0
    self.state, self.layout, meta = self.checkpointer.restore(self.state, self.layout)
    self.loader.position = int(meta["data_position"])
    self.planner.load_state_dict(meta.get("planner", {}))
    return int(meta["step"])

  def save(self, step: int) -> None:
    self.checkpointer.save(step, self.state, self.layout, {
        "data_position": self.loader.position, "planner": self.planner.state_dict()})
    if self.trace is not None:
      self.trace.write()

  def maybe_switch_layout(self, step: int, writer) -> None:
    """dyn.X: before dispatching `step`, re-plan from the finished steps' loads."""
    if not self.planner.due(step):
      return
    n, num_experts = self.mesh.shape["expert"], self.cfg.moe.num_experts
    new, switches = self.planner.propose(to_placements(self.layout, n))
    if not switches:
      return
    jax.block_until_ready(self.state)   # time the switch alone, not the step in flight
    tick = time.perf_counter()
    if self.cfg.moe.expert_mode == "ep":  # slots own weights: move them and their Adam state
      new_layout = jax.device_put(
          from_slot_expert(np.stack([p.slot_expert for p in new]), num_experts),
          self.layout_sharding)
      self.state = migrate(self.state, self.layout, new_layout)
    else:                                 # fsep: the next step restores the new slots
      new_layout = jax.device_put(from_placements(new, num_experts, n), self.layout_sharding)
    jax.block_until_ready((self.state, new_layout))
    seconds = time.perf_counter() - tick
    self.layout = new_layout
    for sw in switches:
      writer.write({"step": step, "event": "layout_switch", "layer": sw.layer,
                    "policy": self.cfg.planner.policy,
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

  def _record(self, step: int, m: dict, tokens_per_s: float) -> dict:
    return {
        "step": step, "loss": float(m["loss"]), "ce": float(m["ce"]),
        "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]), "tokens_per_s": tokens_per_s,
        "moe": metrics_lib.moe_layer_records(m, self.mesh.shape["expert"]),
    }

  def run(self) -> dict:
    cfg = self.cfg
    os.makedirs(cfg.train.run_dir, exist_ok=True)
    if self.is_main:
      with open(os.path.join(cfg.train.run_dir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
      with open(os.path.join(cfg.train.run_dir, "memory.txt"), "w") as f:
        f.write(memory.report(
            cfg.model.num_layers // cfg.moe.moe_every, cfg.moe.num_experts, cfg.model.d_model,
            cfg.moe.d_ff, self.mesh.shape["expert"], self.mesh.shape["model"],
            cfg.moe.slots_per_device or None) + "\n")
    start = self.maybe_restore()
    if cfg.trace.path and self.is_main:
      self.trace = TraceRecorder(cfg.trace.path, cfg.moe.top_k, start)
    writer = metrics_lib.JsonlWriter(os.path.join(cfg.train.run_dir, "metrics.jsonl"),
                                     enabled=self.is_main, start=start)
    bar = tqdm(total=cfg.train.num_steps, initial=start,
               disable=not (self.is_main and cfg.train.progress_bar), dynamic_ncols=True)
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    first = last = None
    pending = None
    self._reads = collections.deque(maxlen=11)   # times at which step metrics became ready
    for step in range(start, cfg.train.num_steps):
      self.maybe_switch_layout(step, writer)
      batch = data_lib.make_global_batch(self.loader.next_local(), self.batch_sharding,
                                         cfg.data.global_batch_size)
      self.state, m = self.train_step(self.state, batch, self.layout)
      if pending is not None:   # read step N-1's metrics after dispatching step N
        last = self._log(writer, bar, *pending, tokens_per_step)
        first = first or last
      pending = (step, m)
      done = step + 1
      eval_now = done % cfg.train.eval_every == 0 or done == cfg.train.num_steps
      save_now = done % cfg.checkpoint.every == 0 and done != cfg.train.num_steps
      if eval_now or save_now:   # write this step's record first: a kill then loses nothing
        last = self._log(writer, bar, *pending, tokens_per_step)
        first = first or last
        pending = None
        if eval_now:   # evaluated after step `step` finished (= at checkpoint `done`)
          writer.write({"step": step, "eval_loss": self.evaluate()})
        if save_now:
          self.save(done)
        self._reads.clear()   # keep eval and checkpoint time out of tokens/s
    if pending is not None:
      last = self._log(writer, bar, *pending, tokens_per_step)
    if cfg.train.num_steps > start or self.checkpointer.latest_step() is None:
      self.save(cfg.train.num_steps)
    if self.trace is not None:
      self.trace.write()
    self.checkpointer.wait()
    bar.close()
    writer.close()
    return {"start_step": start, "first": first, "last": last}

  def _log(self, writer, bar, step, m, tokens_per_step) -> dict:
    m = jax.device_get(m)   # blocks until `step` has finished
    self._reads.append(time.perf_counter())
    span = self._reads[-1] - self._reads[0]
    rate = tokens_per_step * (len(self._reads) - 1) / span if span > 0 else None
    self.planner.observe(m["counts_LxSxE"])
    if self.trace is not None:
      self.trace.add(step, m["counts_LxSxE"], self.mesh.shape["expert"])
    record = self._record(step, m, rate)
    writer.write(record)
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate or 0:.0f}")
    bar.update(step + 1 - bar.n)
    return record


def train(cfg: Config) -> dict:
  trainer = Trainer(cfg)
  try:
    return trainer.run()
  finally:
    trainer.checkpointer.close()
