"""Drifting load: the online strategy switch vs every pool member held fixed, same run.

    python -m benchmarks.strategy.strategy_switch [--gin_file F] [--gin_bindings B ...]
        [--pool SPEC ...] [--also_fixed SPEC ...] [--phases uniform:12,hot:12,uniform:12]
        [--every 2] [--horizon 0] [--fsep_every 0] [--window 2] [--fresh]
        [--max_drop 0.02] [--warmup_steps 150] [--balance_rate 0] [--repeats 1]
        [--profile benchmarks/strategy/results/cost_model_cpu.json]

`main`'s docstring says how.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import start, write_result
from benchmarks.strategy import RESULTS
from benchmarks.turns import Turns, side_by_side
from moejax.config import CheckpointConfig, ConfigError
from moejax.frontend import DEFAULT_GIN, parse_config
from moejax.strategy import offline as plan
from moejax.strategy.cost import PRESETS, expert_shares, load_dispersion
from moejax.strategy.profile_fit import calibrate, save
from moejax.train.controllers import Hook
from moejax.train.programs import CompileCounter
from moejax.train.trainer import Trainer

DEFAULT_PROFILE = os.path.join(RESULTS, "cost_model_cpu.json")


def parse_phases(text: str) -> list[tuple[str, int]]:
  """'uniform:12,hot:12' -> [('uniform', 12), ('hot', 12)] (one-line errors)."""
  out = []
  for part in text.split(","):
    name, _, steps = part.partition(":")
    if name not in ("uniform", "hot") or not steps.isdigit() or int(steps) < 1:
      raise ConfigError(f"--phases part {part!r} must be uniform:N or hot:N with N >= 1, "
                        "e.g. 'uniform:12,hot:12,uniform:12'.")
    out.append((name, int(steps)))
  return out


def hot_schedule(phases, num_experts: int) -> list[int | None]:
  """The hot expert of every step (None in uniform phases); another one each hot phase."""
  out, hot_phase = [], 0
  for name, steps in phases:
    hot = None
    if name == "hot":
      hot, hot_phase = (3 * hot_phase) % num_experts, hot_phase + 1
    out += [hot] * steps
  return out


class LoadSteering:
  """Router bias [L, E] per step: a balancing controller plus the phase's hot expert."""

  def __init__(self, hot_by_step: list, num_layers: int, num_experts: int, rate: float):
    self.hot_by_step, self.rate = hot_by_step, rate
    self.balance_LxE = np.zeros((num_layers, num_experts), np.float32)

  def bias(self, step: int, counts_LxWxE: np.ndarray | None) -> np.ndarray:
    hot = self.hot_by_step[step]
    if counts_LxWxE is not None:               # the last finished step's routing
      c = np.asarray(counts_LxWxE, np.float64).sum(1)
      share = c / np.maximum(c.sum(-1, keepdims=True), 1.0)
      update = self.rate * (1.0 / share.shape[-1] - share)
      if hot is not None:
        update[:, hot] = 0.0
      self.balance_LxE += update.astype(np.float32)
    bias = self.balance_LxE.copy()
    if hot is not None:
      bias[:, hot] += 1.0
    return bias


def resolve_profile(arg: str, tmp: str) -> tuple[str, str]:
  """(profile for strategy.profile, where it came from): a preset, a profile JSON, or a
  cost_model benchmark result (its fitted profile); 'calibrate' runs the micro-benchmarks."""
  if arg in PRESETS:
    return arg, f"preset {arg}"
  path = os.path.join(tmp, "profile.json")
  if arg == "calibrate":
    save(calibrate(), path)
    return path, "micro-benchmarks on this machine (moejax.calibrate)"
  with open(arg) as f:
    data = json.load(f)
  if "profile" in data:                        # a benchmarks/strategy/cost_model.py result
    with open(path, "w") as f:
      json.dump(data["profile"], f)
    return path, f"whole-step fit from {arg}"
  return arg, arg


class TakeTurns(Hook):
  """One step per turn under the load steering; times the run's own turns from the third
  phase step to the last (`step_s`) and counts the compilations inside them (`compiles`)."""

  def __init__(self, steer: LoadSteering, start: int, last: int, label: str, turns: Turns,
               me: int):
    self.steer, self.start, self.last, self.label = steer, start, last, label
    self.turns, self.me = turns, me
    self.step_s: list[float] = []
    self.compiles: list[int] = []              # in timed turns (other runs' turns not counted)
    self.began = 0.0
    self.counter = CompileCounter()
    self.counts_LxWxE = None                   # the latest finished step's routing

  def after_metrics(self, trainer, step, record, counts_LxWxE, member) -> None:
    self.counts_LxWxE = counts_LxWxE

  def before_step(self, trainer, step: int) -> bool:
    start = self.start
    if step < start:
      raise RuntimeError(f"{self.label}: started at step {step}, not at the warm-up's {start}")
    if step > start:                           # a turn ends once its step has finished
      jax.block_until_ready(trainer.state)
      if step > start + 2:
        self.step_s.append(time.perf_counter() - self.began)
        self.counter.__exit__(None, None, None)
        self.compiles.append(self.counter.count)
    if step < self.last:                       # the last step keeps the turn it has
      if step > start:
        self.turns.pass_on(self.me)
      self.turns.wait(self.me)
      self.began = time.perf_counter()
      if step >= start + 2:
        self.counter.__enter__()
    bias = self.steer.bias(step - start, self.counts_LxWxE if step > start else None)
    for member, prog in enumerate(trainer.pool.programs):   # every member: the same steering
      trainer.pool.set_layout(member, prog.layout.replace(router_bias_LxE=bias))
    return False


def run_one(cfg, hot_by_step, rate: float, label: str, warm_dir: str | None,
            turns: Turns, me: int) -> dict:
  """Trains `cfg` from the warm-up checkpoint to the end under the load steering, one step
  per turn (`TakeTurns`). The last step, the final checkpoint and reading the run's records
  keep the turn, untimed."""
  steer = LoadSteering(hot_by_step, cfg.model.num_layers // cfg.moe.moe_every,
                       cfg.moe.num_experts, rate)
  hook = TakeTurns(steer, cfg.train.num_steps - len(hot_by_step), cfg.train.num_steps - 1,
                   label, turns, me)
  try:
    if warm_dir:
      shutil.copytree(os.path.join(warm_dir, "checkpoints"),
                      os.path.join(cfg.train.run_dir, "checkpoints"))
    with Trainer(cfg) as trainer:
      trainer.run(hooks=[hook])
    records = [json.loads(x) for x in open(os.path.join(cfg.train.run_dir, "metrics.jsonl"))]
  finally:
    turns.pass_on(me, finished=True)
  steps = [r for r in records if "loss" in r]
  drops = [float(np.mean([m["dropped_fraction"] for m in r["moe"]])) for r in steps]
  return {"label": label, "seconds": float(np.sum(hook.step_s)), "timed_steps": len(hook.step_s),
          "step_seconds": hook.step_s, "compiles_in_window": int(np.sum(hook.compiles)),
          "dropped_by_step": drops, "strategy_by_step": [r["strategy"] for r in steps],
          "final_loss": steps[-1]["loss"],
          "switches": [{k: r[k] for k in ("step", "from", "to", "reason", "seconds",
                                          "predicted_gain_s", "switch_cost_s")}
                       for r in records if r.get("event") == "strategy_switch"],
          "layout_switches": sum(r.get("event") == "layout_switch" for r in records)}


def phase_drops(drops: list[float], phases) -> list[float]:
  out, at = [], 0
  for _, steps in phases:
    out.append(float(np.mean(drops[at:at + steps])))
    at += steps
  return out


def best_fixed(switching: dict, fixed: list[dict], max_drop: float) -> dict | None:
  """The fastest fixed run that drops at most `max_drop` more than the switching run in
  every phase (`dropped_by_phase`); None when each breaks that somewhere."""
  fair = [r for r in fixed if all(d <= s + max_drop for d, s in
                                  zip(r["dropped_by_phase"], switching["dropped_by_phase"],
                                      strict=True))]
  return min(fair, key=lambda r: r["seconds"]) if fair else None


def main(argv=None) -> int:
  """First `--warmup_steps` of plain training (the config's own strategy, balance
  loss on) take the router past its first steps, where a byte-level model's load
  is far from even; every run below restores that checkpoint (onto its own mesh
  and expert mode) and goes on from the same data position. Without `--pool`, the
  pool is moejax.plan's pick of 2 under the profile, with the expert shares and the
  count dispersion of the warm-up's last 10 steps as its `observed` regime (as
  `python -m moejax.plan --trace` does).

  The load then drifts in phases, steered by the router bias (data in the layout,
  so nothing recompiles). `uniform`: no steering, or with `--balance_rate` > 0 an
  aux-loss-free balancing controller (bias += rate * (mean share - share) per
  expert, from the last finished step). `hot`: a +1 bias puts one expert (another
  one in each hot phase) into every token's top-k, so it gets half of all choices,
  like a collapsed gate. The same data, seed and schedule is trained

    * with the pool, the online stage deciding every `--every` steps, and
    * with each pool member alone (no switching), and each `--also_fixed` spec alone.

  Every run re-plans its layout from the mean of the last `--window` finished steps:
  smartmoe for ep every 4 steps, the fsep planner for fsep every `--fsep_every` steps
  (0: 4). Steps are read one step late unless `--fresh` (`planner.fresh`), which
  plans each step on the one just finished (a turn below waits for its step anyway,
  so that costs these runs no time). The runs train side by side, in threads that
  take turns one step each, so a slow
  spell of this shared machine slows every run alike; each run's time is the sum of
  its own turns (a turn: steering, online stage, dispatch, the last step's metrics,
  until the step has finished) from the third phase step to the last, compilation
  outside it (compilations inside are counted and reported). With `--repeats N`
  this goes round N times, another run taking the first turn each round; each run
  keeps its fastest time (drops are deterministic) and the switching run's ratio to
  the best fixed one is given per round too. "Best fixed" is the fastest
  fixed run whose dropped share in every phase is at most the switching run's in
  that phase plus `--max_drop` (no fixed member keeps every phase under the limit
  once a gate collapses; phase by phase, so long even phases do not dilute a
  member's collapse in the hot one); the fastest fixed run of all is reported too,
  with its drops.
  Writes benchmarks/strategy/results/strategy_switch_<platform>.json.
  """
  p = argparse.ArgumentParser(prog="python -m benchmarks.strategy.strategy_switch",
                              description=__doc__.splitlines()[0])
  p.add_argument("--gin_file", action="append", default=None)
  p.add_argument("--gin_bindings", action="append", default=[])
  p.add_argument("--pool", nargs="*", default=None,
                 help="specs; default: moejax.plan's pool of 2 under the profile")
  p.add_argument("--also_fixed", nargs="*", default=[],
                 help="more specs to train held fixed beside the pool's members, e.g. an ep "
                      "with the capacity a hot expert needs")
  p.add_argument("--phases", default="uniform:12,hot:12,uniform:12")
  p.add_argument("--every", type=int, default=2, help="strategy.every")
  p.add_argument("--horizon", type=int, default=0, help="strategy.horizon (0: --every)")
  p.add_argument("--max_drop", type=float, default=0.02, help="strategy.max_drop")
  p.add_argument("--profile", default=DEFAULT_PROFILE if os.path.exists(DEFAULT_PROFILE)
                 else "calibrate", help="preset, profile JSON, cost_model result, calibrate")
  p.add_argument("--fsep_every", type=int, default=0,
                 help="planner.fsep_every: fsep layouts' re-plan period (0: ep's, 4)")
  p.add_argument("--window", type=int, default=2, help="planner.window")
  p.add_argument("--fresh", action="store_true",
                 help="planner.fresh: plan each step on the one just finished (1 step late)")
  p.add_argument("--warmup_steps", type=int, default=150)
  p.add_argument("--balance_rate", type=float, default=0.0,
                 help="bias step per unit of share error (0 = no balancing controller)")
  p.add_argument("--repeats", type=int, default=1, help="times each run is repeated")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  phases = parse_phases(args.phases)
  num_steps = sum(n for _, n in phases)
  cfg = parse_config(args.gin_file or [DEFAULT_GIN], args.gin_bindings)
  devices = jax.devices()
  tmp = tempfile.mkdtemp(prefix="strategy_switch_")
  profile, profile_from = resolve_profile(args.profile, tmp)
  hot_by_step = hot_schedule(phases, cfg.moe.num_experts)

  warm_dir, dispersion, observed, regimes = None, 1.0, None, plan.REGIMES
  if args.warmup_steps:
    warm_dir = os.path.join(tmp, "warmup")
    tick = time.perf_counter()
    with Trainer(dataclasses.replace(
        cfg, checkpoint=CheckpointConfig(every=10**6, keep=1),
        train=dataclasses.replace(cfg.train, run_dir=warm_dir, num_steps=args.warmup_steps,
                                  eval_every=10**6, progress_bar=False))) as warm:
      summary = warm.run()
    records = [json.loads(x) for x in open(os.path.join(warm_dir, "metrics.jsonl"))]
    counts = [[m["counts_by_source"] for m in r["moe"]] for r in records if "loss" in r]
    last_stepsxLxWxE = np.asarray(counts[-10:])
    dispersion = load_dispersion(last_stepsxLxWxE)
    observed, regimes = expert_shares(last_stepsxLxWxE), plan.OBSERVED_REGIMES
    print(f"warm-up: {args.warmup_steps} steps in {time.perf_counter() - tick:.0f}s, loss "
          f"{summary['last']['loss']:.3f}, dropped "
          f"{np.mean([m['dropped_fraction'] for m in summary['last']['moe']]):.1%}, count "
          f"dispersion {dispersion:.1f}")

  pool = args.pool or [s.spec for s in plan.pick_pool(
      plan.rank(cfg, plan.load_profile(profile), len(devices), regimes=regimes,
                dispersion=dispersion, observed_LxE=observed), 2, args.max_drop, regimes)]
  print(f"profile: {profile_from}\npool: {', '.join(pool)}\nphases: {args.phases}")

  def config(members, name):
    return dataclasses.replace(
        cfg, strategy=dataclasses.replace(cfg.strategy, pool=tuple(members), every=args.every,
                                          horizon=args.horizon, profile=profile,
                                          max_drop=args.max_drop),
        planner=dataclasses.replace(cfg.planner, policy="smartmoe", every=4, window=args.window,
                                    fsep_every=args.fsep_every, fresh=args.fresh),
        checkpoint=CheckpointConfig(every=10**6, keep=1),
        train=dataclasses.replace(cfg.train, run_dir=os.path.join(tmp, name),
                                  num_steps=args.warmup_steps + num_steps, eval_every=10**6,
                                  progress_bar=False))

  fixed_specs = pool + [spec for spec in args.also_fixed if spec not in pool]
  members = list(enumerate([("switching", pool)] +
                           [(f"fixed {spec}", [spec]) for spec in fixed_specs]))
  by_label: dict = {}
  for repeat in range(args.repeats):           # side by side, a step each in turn; each run
    turn = repeat % len(members)               # goes first in some round
    order = members[turn:] + members[:turn]
    jobs = [functools.partial(run_one, config(specs, f"run{i}_{repeat}"), hot_by_step,
                              args.balance_rate, label, warm_dir) for i, (label, specs) in order]
    for (_, (label, _)), r in zip(order, side_by_side(jobs), strict=True):
      by_label.setdefault(label, r).setdefault("seconds_all", []).append(r["seconds"])
  runs = list(by_label.values())
  for r in runs:
    r["seconds"] = min(r["seconds_all"])       # the same work each time: noise only adds
    r["dropped"] = float(np.mean(r["dropped_by_step"]))
    r["dropped_by_phase"] = phase_drops(r["dropped_by_step"], phases)
  switching, fixed = runs[0], runs[1:]
  best = best_fixed(switching, fixed, args.max_drop)
  fastest = min(fixed, key=lambda r: r["seconds"])

  names = [n for n, _ in phases]
  print(f"\n{'run':<34}{'seconds':>9}{'ms/step':>9}{'dropped':>9}  per phase "
        f"({', '.join(names)}){'':>4}switches  compiles")
  for r in runs:
    per = " ".join(f"{d:6.1%}" for d in r["dropped_by_phase"])
    print(f"{r['label']:<34}{r['seconds']:9.2f}{r['seconds'] / r['timed_steps'] * 1e3:9.1f}"
          f"{r['dropped']:9.2%}  {per:<28}{len(r['switches']):>8}{r['compiles_in_window']:>10}")
  for s in switching["switches"]:
    print(f"  switch at step {s['step']}: {s['from']} -> {s['to']} ({s['reason']}, "
          f"{s['seconds'] * 1e3:.0f} ms)")
  by_round = {r["label"]: [a / b for a, b in zip(switching["seconds_all"], r["seconds_all"])]
              for r in fixed}
  if best is None:
    print(f"every fixed member drops over the switching run's + {args.max_drop:.1%} in a phase; "
          f"fastest fixed: {fastest['label']} {fastest['seconds']:.2f}s at "
          f"{fastest['dropped']:.1%} dropped")
  else:
    print(f"switching {switching['seconds']:.2f}s ({switching['dropped']:.1%} dropped) vs best "
          f"fixed {best['label']} {best['seconds']:.2f}s ({best['dropped']:.1%} dropped): "
          f"ratio {switching['seconds'] / best['seconds']:.3f}")
  for label, ratios in by_round.items():
    print(f"switching / {label}: " + " ".join(f"{x:.3f}" for x in ratios) + " (per round)")
  result = {"device": f"{devices[0].platform} x{len(devices)} ({devices[0].device_kind})",
            "command": ("python -m benchmarks.strategy.strategy_switch "
                        + " ".join(argv or sys.argv[1:])),
            "profile": profile_from, "pool": pool, "also_fixed": args.also_fixed,
            "phases": args.phases,
            "every": args.every, "horizon": args.horizon, "max_drop": args.max_drop,
            "fsep_every": args.fsep_every, "fresh": args.fresh, "window": args.window,
            "balance_rate": args.balance_rate, "warmup_steps": args.warmup_steps,
            "warmup_dispersion": dispersion, "runs": runs,
            "best_fixed": best and best["label"],
            "ratio_switching_over_best_fixed": best and switching["seconds"] / best["seconds"],
            "ratio_by_repeat": best and by_round[best["label"]],
            "ratio_by_repeat_over_each_fixed": by_round,
            "fastest_fixed": fastest["label"],
            "ratio_switching_over_fastest_fixed": switching["seconds"] / fastest["seconds"]}
  write_result(result, args.out or
               os.path.join(RESULTS, f"strategy_switch_{devices[0].platform}.json"))
  return 0


if __name__ == "__main__":
  start()
  raise SystemExit(main())
