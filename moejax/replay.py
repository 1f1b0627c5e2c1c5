"""`python -m moejax.replay TRACE.npz --devices N --slots C --policy P`: replays a routing trace
through placement policies with lagged statistics, beside the `oracle` (the fsep planner given
each step's own counts), and prints each policy's regret over it (library:
`moejax.placement.replay`)."""

from __future__ import annotations

import ast
import dataclasses
import json

from moejax.config import ConfigError, ModelConfig, MoEConfig, StrategyConfig
from moejax.placement.policies import POLICIES, make_options
from moejax.placement.replay import format_table, oracle, policy_names, replay, with_regret
from moejax.placement.workloads import load_trace
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
  ap.add_argument("--every", type=int, default=10, help="Re-plan every K steps (default 10).")
  ap.add_argument("--adaptive", action="store_true",
                  help="Consider a re-plan after every step and switch a layer only when its "
                       "predicted compute gain over --every steps beats its priced migration "
                       "(planner.adaptive).")
  ap.add_argument("--window", type=int, default=10,
                  help="Predict from the last W steps (default 10).")
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
    results = {name: replay(counts, a.devices, a.slots, name, a.every, a.window, cost=cost,
                            options=fsep_options if name == "fsep" else None, shares=a.shares,
                            adaptive=a.adaptive)
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
  print(f"{a.trace}: steps={steps} layers={layers} sources={sources} experts={experts} | "
        f"devices={a.devices} slots={a.slots} every={a.every} adaptive={a.adaptive} "
        f"window={a.window} "
        f"shares={a.shares}")
  print("max/mean device load over steps x layers (realized on each step's actual counts); "
        "pred med = median max/mean of each decision on the load it was planned from; "
        "crossing = (token, k) rows sent off their source device")
  extra = {"window_oracle": ahead} if ahead else {}
  print(format_table({**results, **extra, **({"oracle": bound} if bound else {})}))
  if a.layers:
    print(report(a.layers, experts, a.d_model, a.d_ff, a.devices, fsep_slots=a.slots))
  if a.json:
    out = {"trace": a.trace, "devices": a.devices, "slots": a.slots, "every": a.every,
           "adaptive": a.adaptive,
           "window": a.window, "shares": a.shares, "cost": dataclasses.asdict(cost),
           "sources": sources, "experts": experts,
           "steps": steps, "layers": layers, "fsep_options": dict(_option(text) for text in a.fsep),
           "policies": results, "oracle": bound, **extra}
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {a.json}")
  return 0


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
