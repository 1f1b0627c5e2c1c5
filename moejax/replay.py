"""`python -m moejax.replay TRACE.npz --devices N --slots C --policy P`: replays a routing trace
through placement policies with lagged statistics (library: `moejax.placement.replay`)."""

from __future__ import annotations

import argparse
import json

from moejax.config import ConfigError
from moejax.placement.policies import POLICIES
from moejax.placement.replay import format_table, policy_names, replay
from moejax.placement.workloads import load_trace
from moejax.strategy.memory import report


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m moejax.replay",
                               description="Replay a routing trace through placement policies.")
  ap.add_argument("trace", help="routing trace .npz (counts[steps, layers, sources, experts])")
  ap.add_argument("--devices", type=int, required=True, help="devices N in the expert group")
  ap.add_argument("--slots", type=int, required=True,
                  help="expert slots per device C (one-copy policies use E/N)")
  ap.add_argument("--policy", default="all", help=f"one of {sorted(POLICIES)} or 'all'")
  ap.add_argument("--every", type=int, default=10, help="re-plan every K steps")
  ap.add_argument("--window", type=int, default=10, help="predict from the last W steps")
  ap.add_argument("--json", default=None, help="write results here")
  ap.add_argument("--d_model", type=int, default=0,
                  help="with --d_ff and --layers: also print expert memory per device")
  ap.add_argument("--d_ff", type=int, default=0, help="expert hidden size (memory report)")
  ap.add_argument("--layers", type=int, default=0, help="MoE layers (memory report)")
  a = ap.parse_args(argv)
  try:
    counts = load_trace(a.trace)["counts"]
    results = {name: replay(counts, a.devices, a.slots, name, a.every, a.window)
               for name in policy_names(a.policy)}
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  steps, layers, sources, experts = counts.shape
  print(f"{a.trace}: steps={steps} layers={layers} sources={sources} experts={experts} | "
        f"devices={a.devices} slots={a.slots} every={a.every} window={a.window}")
  print("max/mean device load over steps x layers (realized on each step's actual counts); "
        "pred med = median max/mean of each decision on the load it was planned from; "
        "crossing = (token, k) rows sent off their source device")
  print(format_table(results))
  if a.d_model and a.d_ff and a.layers:
    print(report(a.layers, experts, a.d_model, a.d_ff, a.devices, fsep_slots=a.slots))
  if a.json:
    out = {"trace": a.trace, "devices": a.devices, "slots": a.slots, "every": a.every,
           "window": a.window, "sources": sources, "experts": experts, "steps": steps,
           "layers": layers, "policies": results}
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
  main()
