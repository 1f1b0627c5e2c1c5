"""`python -m moejax.plan`: the offline stage; ranks every strategy for a config on a hardware
profile and picks a small pool (library: `moejax.strategy.offline`)."""

from __future__ import annotations

import argparse
import json
import sys

from moejax.config import ConfigError
from moejax.frontend import DEFAULT_GIN, parse_config
from moejax.placement.workloads import load_trace
from moejax.strategy.cost import expert_shares, load_dispersion, load_profile
from moejax.strategy.offline import (
  OBSERVED_REGIMES,
  REGIMES,
  pick_pool,
  rank,
  table,
  to_json,
  train_bindings,
  why_nothing_fits,
)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m moejax.plan",
                                   description=__doc__.splitlines()[0].split(": ", 1)[-1])
  parser.add_argument("--gin_file", action="append", default=None)
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--profile", default="h100_node",
                      help="preset name, a JSON written by `python -m moejax.calibrate`, or a "
                      "benchmarks/cost_model.py result (its fitted profile)")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--pool", type=int, default=4)
  parser.add_argument("--max_drop", type=float, default=0.01)
  parser.add_argument("--dispersion", type=float, default=None,
                      help="count variance / mean per source and expert (1 = independent "
                      "tokens; byte-level text after warm-up: about 6-9); default: the "
                      "trace's, or 1")
  parser.add_argument("--trace", default=None,
                      help="routing trace .npz of a run (trace.path): plan for its observed "
                      "expert shares instead of even ones")
  parser.add_argument("--trace_steps", type=int, default=10,
                      help="the trace's last steps that make the observed load")
  parser.add_argument("--json", default=None)
  parser.add_argument("--verify", type=int, default=0, metavar="K",
                      help="compile the top K candidates with XLA:GPU for the profile's GPU "
                      "and --devices (no GPU needed; the gpu_aot extra) and print XLA's "
                      "memory and the schedule's step estimate beside the predictions")
  args = parser.parse_args(argv)
  try:
    cfg = parse_config(args.gin_file or [DEFAULT_GIN], args.gin_bindings)
    profile = load_profile(args.profile)
    dispersion, observed, regimes = args.dispersion, None, REGIMES
    if args.trace:
      if args.trace_steps < 1:
        raise ConfigError(f"--trace_steps={args.trace_steps} must be >= 1.")
      counts = load_trace(args.trace)["counts"][-args.trace_steps:]
      observed, regimes = expert_shares(counts), OBSERVED_REGIMES
      if dispersion is None:
        dispersion = load_dispersion(counts)
    dispersion = 1.0 if dispersion is None else dispersion
    if dispersion < 1.0:
      raise ConfigError(f"--dispersion={dispersion} must be >= 1 (1 = independent tokens).")
    if args.devices < 1:
      raise ConfigError(f"--devices={args.devices} must be >= 1.")
    rank_kwargs = dict(regimes=regimes, dispersion=dispersion, observed_LxE=observed)
    rows = rank(cfg, profile, args.devices, **rank_kwargs)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"profile {profile.name}; {args.devices} devices; drop limit {args.max_drop:.1%}; "
        f"count dispersion {dispersion:.1f}" +
        (f"; observed load: last {len(counts)} steps of {args.trace}" if args.trace else ""))
  try:
    pool = pick_pool(rows, args.pool, args.max_drop, regimes)
  except ConfigError as e:
    if all(r.rejected for r in rows):   # the table and the reasons, then the one error line
      print(table(rows, regimes))
      print("\n".join(why_nothing_fits(cfg, profile, args.devices, rows, **rank_kwargs)))
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(table(rows, regimes))
  print("pool: " + ", ".join(s.spec for s in pool))
  print("train with: " + " ".join(f'--gin_bindings="{b}"' for b in train_bindings(pool)))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(to_json(rows, pool, profile), f, indent=2)
  if args.verify:
    from moejax.aot.verify import verify
    try:
      verify(cfg, rows, args.verify, regimes[0], args.max_drop, profile.name, args.devices)
    except ConfigError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
