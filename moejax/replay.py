"""`python -m moejax.replay TRACE.npz --devices N --slots C --policy P`: replays a routing trace
through placement policies with lagged statistics, beside the `oracle` (the fsep planner given
each step's own counts), and prints each policy's regret over it (library:
`moejax.placement.trace_replay`). `--trainer` replays through the trainer's own re-planner, its
defaults and its one-step-late reading of the metrics (`replay_trainer`)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json

from moejax.config import ConfigError, ModelConfig, MoEConfig, PlannerConfig, StrategyConfig
from moejax.placement import trace_replay as replay_lib
from moejax.placement.policies import POLICIES, make_options
from moejax.placement.replanner import OnlinePlanner, adaptive_for
from moejax.placement.synthetic import load_trace
from moejax.placement.trace_replay import format_table, oracle, policy_names, replay, with_regret
from moejax.runtime.cli import ArgumentParser, fail
from moejax.strategy.cost import load_profile
from moejax.strategy.memory import report
from moejax.strategy.placement_cost import placement_cost


def parser() -> ArgumentParser:
  ap = ArgumentParser(prog="python -m moejax.replay",
                      description="Replays a routing trace through placement policies with "
                                  "lagged statistics, beside the oracle, and prints each "
                                  "policy's load balance and regret.")
  ap.add_argument("trace", help="The routing trace .npz (counts[steps, layers, sources, "
                                "experts]) a run writes with trace.path set.")
  ap.add_argument("--devices", type=int, required=True,
                  help="The number of devices N in the expert group.")
  ap.add_argument("--slots", type=int, required=True,
                  help="The expert slots per device C (one-copy policies use E/N).")
  ap.add_argument("--policy", default="all",
                  help=f"One of {sorted(POLICIES)}, or 'all' (the default).")
  ap.add_argument("--every", type=int, default=None,
                  help="Re-plan every K steps (default 10; with --trainer planner.every's, "
                       f"{PlannerConfig.every}).")
  ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                  help="Consider a re-plan after every step and switch a layer only when its "
                       "predicted compute gain over --every steps beats its priced migration "
                       "(planner.adaptive). Default: the trainer's, per policy: on for fsep "
                       "(its switches move no weights), off for the others.")
  ap.add_argument("--window", type=int, default=PlannerConfig.window,
                  help=f"Predict from the last W steps (default {PlannerConfig.window}).")
  ap.add_argument("--trainer", action="store_true",
                  help="Replay static, smartmoe and fsep through the trainer's own re-planner "
                       "(planner.* defaults, the options it derives from --capacity_factor and "
                       "--capacity) and its loop, which reads a step's metrics after "
                       "dispatching the next: the layout of step t is planned from steps up to "
                       "t - 2.")
  ap.add_argument("--capacity_factor", type=float, default=MoEConfig.capacity_factor,
                  help="With --trainer: moe.capacity_factor, which the fsep planner sizes "
                       "its buffers by (and SmartMoE scores drops at, under --capacity device).")
  ap.add_argument("--capacity", default=MoEConfig.capacity, choices=("slot", "device"),
                  help="With --trainer: moe.capacity (default %(default)s; the default job "
                       "pools per device).")
  ap.add_argument("--json", default=None, help="Also write the results to this JSON file.")
  ap.add_argument("--fsep", action="append", default=[], metavar="NAME=VALUE",
                  help="An fsep planner option (FsepOptions), e.g. plan_for='mean' or "
                       "locality=False; repeatable; the oracle uses it too.")
  ap.add_argument("--shares", default="planned", choices=("planned", "adaptive"),
                  help="The fsep token shares: the planned ones, held between decisions, or "
                       "re-levelled every step from the step's own counts (the layer's "
                       "moe.fsep_shares='adaptive'); for every fsep row and the oracle.")
  ap.add_argument("--no_oracle", action="store_true",
                  help="Skip the oracle row (it plans every step of every layer).")
  ap.add_argument("--window_oracle", action="store_true",
                  help="Add a window_oracle row: fsep given the --every steps each layout "
                       "will serve (the per-step noise floor of a held layout).")
  ap.add_argument("--d_model", type=int, default=ModelConfig.d_model,
                  help="The model width, for the planners' cost model and the memory report.")
  ap.add_argument("--d_ff", type=int, default=MoEConfig.d_ff,
                  help="The expert hidden size, for the planners' cost model and the memory "
                       "report.")
  ap.add_argument("--dtype", default=ModelConfig.dtype,
                  help="The activation dtype (model.dtype), for the planners' cost model.")
  ap.add_argument("--profile", default=StrategyConfig.profile,
                  help="The hardware profile of the cost model (strategy.profile: a preset "
                       "name or a calibrated JSON).")
  ap.add_argument("--layers", type=int, default=0,
                  help="The MoE layers: also print the expert memory per device.")
  return ap


def main(argv=None) -> int:
  a = parser().parse_args(argv)
  try:
    fsep_options = make_options("fsep", **dict(_option(text) for text in a.fsep))
    cost = placement_cost(ModelConfig(d_model=a.d_model, dtype=a.dtype), MoEConfig(d_ff=a.d_ff),
                          load_profile(a.profile))
    counts = load_trace(a.trace)["counts"]
    if not counts.shape[0]:
      raise ConfigError(f"trace {a.trace} holds 0 steps; give the trace of a run that trained "
                        "at least one step with trace.path set.")
    a.every = a.every if a.every is not None else PlannerConfig.every if a.trainer else 10
    if a.trainer:
      results = _trainer_rows(a, counts, cost)
    else:
      results = {name: {**replay(counts, a.devices, a.slots, name, a.every, a.window, cost=cost,
                                 options=fsep_options if name == "fsep" else None,
                                 shares=a.shares, adaptive=_adaptive(a, name)),
                        "adaptive": _adaptive(a, name)}
                 for name in policy_names(a.policy)}
    bound = None if a.no_oracle else oracle(counts, a.devices, a.slots, cost=cost,
                                            options=fsep_options,
                                            shares=a.shares)
    ahead = (replay(counts, a.devices, a.slots, "fsep", a.every, a.window, cost=cost,
                    options=fsep_options, lookahead=True, shares=a.shares)
             if a.window_oracle else None)
  except ConfigError as e:
    return fail(str(e))
  if bound is not None:
    with_regret({**results, **({"window_oracle": ahead} if ahead else {})}, bound)
  steps, layers, sources, experts = counts.shape
  adaptive = ", ".join(f"{name} {'on' if r['adaptive'] else 'off'}" for name, r in results.items())
  print(f"{a.trace}: steps={steps} layers={layers} sources={sources} experts={experts} | "
        f"devices={a.devices} slots={a.slots} every={a.every} adaptive: {adaptive} | "
        f"window={a.window} shares={a.shares}"
        + (f" | the trainer's re-planner, capacity_factor={a.capacity_factor} capacity="
           f"{a.capacity}" if a.trainer else ""))
  print("max/mean device load over steps x layers (realized on each step's actual counts); "
        "pred med = median max/mean of each decision on the load it was planned from; "
        "crossing = (token, k) rows sent off their source device")
  extra = {"window_oracle": ahead} if ahead else {}
  print(format_table({**results, **extra, **({"oracle": bound} if bound else {})}))
  if a.layers:
    print(report(a.layers, experts, a.d_model, a.d_ff, a.devices, fsep_slots=a.slots))
  if a.json:
    out = {"trace": a.trace, "devices": a.devices, "slots": a.slots, "every": a.every,
           "adaptive": a.adaptive, "trainer": a.trainer,
           "window": a.window, "shares": a.shares, "cost": dataclasses.asdict(cost),
           "sources": sources, "experts": experts,
           "steps": steps, "layers": layers, "fsep_options": dict(_option(text) for text in a.fsep),
           "policies": results, "oracle": bound, **extra}
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {a.json}")
  return 0


def _adaptive(a, policy: str) -> bool:
  """--adaptive where given; else the trainer's default for `policy`."""
  return adaptive_for(PlannerConfig(policy=policy, adaptive=a.adaptive))


def _trainer_rows(a, counts, cost) -> dict:
  """Each trainer policy replayed through the trainer's re-planner (`replay_trainer`)."""
  if a.fsep:
    raise ConfigError("--fsep sets replay's fsep options; with --trainer the trainer's own "
                      "options apply (planner.fsep_*, --capacity_factor, --capacity): drop it.")
  wanted = [p for p in policy_names(a.policy) if p in ("static", "smartmoe", "fsep")]
  if not wanted:
    raise ConfigError(f"--policy {a.policy!r} does not run in training; with --trainer use "
                      "static, smartmoe, fsep or all.")
  rows = {}
  for name in wanted:
    cfg = PlannerConfig(policy=name, every=a.every, window=a.window, adaptive=a.adaptive)
    planner = OnlinePlanner(cfg, a.devices, cost, capacity_factor=a.capacity_factor,
                            capacity=a.capacity)
    rows[name] = {**replay_lib.replay_trainer(counts, planner, a.slots, shares=a.shares),
                  "adaptive": planner.adaptive}
  return rows


def _option(text: str) -> tuple[str, object]:
  """'name=value' -> (name, value), the value read as a Python literal where it is one."""
  name, sep, value = text.partition("=")
  if not sep or not name:
    raise ConfigError(f"--fsep {text!r} is not NAME=VALUE; e.g. --fsep locality=False.")
  try:
    return name.strip(), ast.literal_eval(value.strip())
  except (ValueError, SyntaxError):
    return name.strip(), value.strip()


if __name__ == "__main__":
  raise SystemExit(main())
