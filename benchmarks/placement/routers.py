"""Routers x placement on the default job: {softmax + balance loss, sigmoid + bias} x
{static, smartmoe, fsep}, trained side by side.

Each arm is the default job's model and data (configs/default.gin: 8 fake CPU devices as
2 x 4 x 1, capacity pooled per device), built as a `Trainer` in its own temporary run dir,
and the six arms run interleaved step by step (arm order rotating each step), so machine
load drifts hit every arm alike. Arms:

  python -m benchmarks.placement.routers [--steps 300] [--every 50] [--json PATH]

`main`'s docstring says how.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import command, start, write_result
from benchmarks.placement import RESULTS
from moejax.frontend import DEFAULT_GIN, parse_config
from moejax.train import data as data_lib, metrics as metrics_lib
from moejax.train.trainer import Trainer

GATES = ("softmax", "sigmoid")
PLACEMENTS = ("static", "smartmoe", "fsep")


class _Events:
  """Stands in for the trainer's metrics writer: the re-planner logs its switches here."""

  def __init__(self):
    self.records = []

  def write(self, record: dict) -> None:
    self.records.append(record)


def arm_config(base, gate: str, placement: str, steps: int, every: int, bias_rate: float,
               run_dir: str):
  moe = dataclasses.replace(base.moe, gate=gate)
  if gate == "sigmoid":
    moe = dataclasses.replace(moe, bias_rate=bias_rate, balance_loss_weight=1e-4,
                              z_loss_weight=0.0)
  planner = dataclasses.replace(base.planner, every=every, fsep_every=every,
                                policy={"static": "static", "smartmoe": "smartmoe",
                                        "fsep": "fsep"}[placement])
  if placement == "fsep":
    moe = dataclasses.replace(moe, expert_mode="fsep")
  train = dataclasses.replace(base.train, num_steps=steps, run_dir=run_dir, progress_bar=False,
                              tensorboard=False)
  return dataclasses.replace(base, moe=moe, planner=planner, train=train).validate()


def _step(trainer: Trainer, step: int, events: _Events) -> tuple[float, dict]:
  """One training step of `trainer` with its controllers (the re-planner), timed alone."""
  for hook in trainer.controllers:
    hook.before_step(trainer, step)
  prog = trainer.pool.program
  batch = data_lib.make_global_batch(trainer.loader.next_local(), prog.batch_sharding,
                                     trainer.cfg.data.global_batch_size)
  jax.block_until_ready(trainer.state)
  tick = time.perf_counter()
  trainer.state, m = prog.train_step(trainer.state, batch, prog.layout)
  m = jax.device_get(m)
  seconds = time.perf_counter() - tick
  record = {"moe": metrics_lib.moe_layer_records(m, prog.mesh.shape["expert"])}
  for hook in trainer.controllers:
    hook.after_metrics(trainer, step, record, m["counts_LxWxE"], trainer.pool.active)
  del events
  return seconds, record


def run(steps: int, every: int, bias_rate: float, gin_file: str) -> dict:
  base = parse_config([gin_file], [])
  arms, trainers, events = [], {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    for gate in GATES:
      for placement in PLACEMENTS:
        name = f"{gate}/{placement}"
        cfg = arm_config(base, gate, placement, steps, every, bias_rate,
                         os.path.join(tmp, name.replace("/", "_")))
        tick = time.perf_counter()
        trainers[name] = Trainer(cfg)
        events[name] = trainers[name].writer = _Events()
        print(f"built {name} in {time.perf_counter() - tick:.1f} s", flush=True)
        arms.append(name)
    timing = {a: [] for a in arms}
    late = {a: {"mom": [], "dropped": 0, "choices": 0} for a in arms}
    for step in range(steps):
      order = arms[step % len(arms):] + arms[:step % len(arms)]
      for a in order:
        seconds, record = _step(trainers[a], step, events[a])
        if step >= steps // 2:
          timing[a].append(seconds)
          for rec in record["moe"]:
            late[a]["mom"].append(rec["realised_max_over_mean"])
            choices = sum(rec["expert_counts"])
            late[a]["dropped"] += rec["dropped_fraction"] * choices
            late[a]["choices"] += choices
      if (step + 1) % 10 == 0:
        print(f"step {step + 1}/{steps}", flush=True)
    tokens = base.data.global_batch_size * base.data.seq_len
    rows = []
    for a in arms:
      t = trainers[a]
      rows.append({
          "arm": a, "eval_loss": t.evaluate(),
          "realised_max_over_mean": float(np.mean(late[a]["mom"])),
          "dropped_fraction": late[a]["dropped"] / max(late[a]["choices"], 1),
          "tokens_per_s": tokens / statistics.median(timing[a]),
          "layout_switches": sum(1 for r in events[a].records if r.get("event") ==
                                 "layout_switch"),
          "final_bias_abs_max": float(np.abs(np.asarray(t.state.router_bias_LxE)).max())})
      t.close()
  return {"rows": rows}


def table(rows: list[dict]) -> str:
  lines = ["| router / placement | eval loss | realised max/mean | dropped | tokens/s |",
           "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['arm']} | {r['eval_loss']:.4f} | {r['realised_max_over_mean']:.3f} | "
                 f"{r['dropped_fraction']:.2%} | {r['tokens_per_s']:.0f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  """softmax  moe.gate = 'softmax', switch balance loss 0.01 (the default job's router)
    sigmoid  moe.gate = 'sigmoid', moe.bias_rate (aux-loss-free bias), sequence-wise balance
             loss 1e-4, z-loss off
    static   ep, the static layout; smartmoe: ep, SmartMoE re-placement every --every steps;
    fsep     fsep experts, the fsep planner every --every steps

  Reported per arm: the eval loss after the last step (train.eval_batches batches), and over
  the second half of the steps the realised max/mean device load (rows each device computed
  after capacity), the dropped share of (token, k) choices, and tokens/s (median step time,
  each step timed alone with its metrics read back). On CPU the 8 devices share the host's
  cores: tokens/s reflects work, not a GPU's speed or network time.
  """
  parser = argparse.ArgumentParser(prog="python -m benchmarks.placement.routers",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--every", type=int, default=50, help="re-placement period (steps)")
  parser.add_argument("--bias_rate", type=float, default=1e-3)
  parser.add_argument("--gin_file", default=DEFAULT_GIN)
  parser.add_argument("--json", default=os.path.join(RESULTS, "routers_cpu.json"))
  args = parser.parse_args(argv)
  if args.steps < 2 or args.every < 0 or args.bias_rate < 0:
    print(f"error: --steps={args.steps} must be >= 2, --every={args.every} >= 0 and "
          f"--bias_rate={args.bias_rate} >= 0.", file=sys.stderr)
    return 2
  tick = time.perf_counter()
  result = run(args.steps, args.every, args.bias_rate, args.gin_file)
  print(table(result["rows"]))
  result.update(command=command("placement.routers", argv), steps=args.steps, every=args.every,
                bias_rate=args.bias_rate, gin_file=os.path.relpath(args.gin_file),
                jax=jax.__version__, devices=jax.device_count(),
                wall_s=time.perf_counter() - tick,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
  write_result(result, args.json)
  return 0


if __name__ == "__main__":
  start()
  raise SystemExit(main())
