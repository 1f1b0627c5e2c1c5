"""`python -m moejax.plan`: the offline stage; ranks every strategy for a config on a hardware
profile, picks a small pool and prints a summary: the best strategy, the pool and why, the
`train.py` command that trains it as planned (switching included) and how to launch it on the
devices planned for; `--all` adds the table of every strategy (library:
`moejax.strategy.offline`)."""

from __future__ import annotations

import json
import os
import shlex
import sys

from moejax.config import ConfigError
from moejax.frontend import DEFAULT_GIN, parse_config
from moejax.placement.synthetic import load_trace
from moejax.runtime.cli import ArgumentParser
from moejax.strategy.cost import PRESETS, expert_shares, load_dispersion, load_profile
from moejax.strategy.offline import (
  OBSERVED_REGIMES,
  REGIMES,
  pick_pool,
  pipeline_of,
  rank,
  table,
  to_json,
  train_bindings,
  why_nothing_fits,
)


def parser() -> ArgumentParser:
  p = ArgumentParser(
      prog="python -m moejax.plan",
      description="The offline stage: ranks every strategy (mesh, expert mode, capacity, "
                  "dispatch, pipeline, FSDP) for a config on a hardware profile, picks a small "
                  "pool to switch among, and prints how to train it.")
  p.add_argument("--gin_file", action="append", default=None,
                 help="A gin config file (repeatable); default: configs/default.gin.")
  p.add_argument("--gin_bindings", action="append", default=[],
                 help="A gin binding such as 'moe.num_experts = 16' (repeatable).")
  p.add_argument("--profile", default="h100_node",
                 help=f"The hardware profile: a preset ({', '.join(sorted(PRESETS))}), a JSON "
                      "written by `python -m moejax.calibrate`, or a "
                      "benchmarks/strategy/cost_model.py result (its fitted profile).")
  p.add_argument("--devices", type=int, default=8,
                 help="The number of devices to plan for (default 8).")
  p.add_argument("--pool", type=int, default=4,
                 help="How many strategies the pool holds, 1 to 4 (default 4); each is a "
                      "compiled program the trainer can switch to.")
  p.add_argument("--max_drop", type=float, default=0.01,
                 help="The largest share of (token, k) choices a strategy may drop to count as "
                      "fitting (default 0.01).")
  p.add_argument("--dispersion", type=float, default=None,
                 help="The count variance / mean per source and expert (1 = independent "
                      "tokens; byte-level text after warm-up: about 6-9); default: the trace's, "
                      "or 1.")
  p.add_argument("--trace", default=None,
                 help="A routing trace .npz of a run (trace.path): plan for its observed expert "
                      "shares instead of even ones.")
  p.add_argument("--trace_steps", type=int, default=10,
                 help="How many of the trace's last steps make the observed load (default 10).")
  p.add_argument("--every", type=int, default=50,
                 help="How often, in steps, the trained run considers switching pool members: "
                      "strategy.every in the printed command (default 50).")
  p.add_argument("--gpus_per_host", type=int, default=8,
                 help="GPUs per host, for the printed multi-host launch line (default 8).")
  p.add_argument("--json", default=None,
                 help="Also write every row and the pool to this JSON file.")
  p.add_argument("--all", action="store_true",
                 help="Print the table of every strategy ranked, after the summary.")
  p.add_argument("--verify", type=int, default=0, metavar="K",
                 help="Compile the top K candidates with XLA:GPU for the profile's GPU and "
                      "--devices (no GPU needed; the gpu-aot extra) and print XLA's memory "
                      "and the schedule's step estimate beside the predictions.")
  return p


def why(rows: list, pool: list, max_drop: float, regimes) -> list[str]:
  """One line per pool member: the load regime where it ranks best among the strategies that
  fit (with the first member's pipeline), its predicted step time and drops there."""
  ok = [r for r in rows if r.rejected is None and
        pipeline_of(r.strategy) == pipeline_of(pool[0])]
  order = {g: [r.strategy for r in sorted(ok, key=lambda r, g=g: r.score(g, max_drop))]
           for g in regimes}
  by_spec = {r.strategy: r for r in ok}
  lines = []
  for s in pool:
    depth = min(order[g].index(s) for g in regimes)
    where = [g for g in regimes if order[g].index(s) == depth]   # in the regimes' order
    cost = by_spec[s].costs[where[0]]
    rank_text = "the best" if depth == 0 else f"number {depth + 1}"
    lines.append(f"  {s.spec}: {rank_text} under {' and '.join(where)} load, "
                 f"{cost.total_s * 1e3:.2f} ms a step, {cost.drop_fraction:.1%} of choices "
                 f"dropped" + (f" (under {where[0]})" if len(where) > 1 else ""))
  return lines


def on_cpu(profile) -> bool:
  """The profile prices fake CPU devices (the `cpu` preset, or one calibrated on CPU)."""
  return profile.name == "cpu" or ":cpu" in profile.name


def train_command(gin_files: list[str], user_bindings: list[str], pool: list, args, cfg,
                  cpu: bool) -> str:
  """The train.py command that trains `pool` as planned: the pool, its pipeline, the
  switching period and the profile the switcher and the planner price with; on CPU as many
  fake devices as were planned for."""
  files = " ".join(f"--gin_file={shlex.quote(os.path.relpath(f))}" for f in gin_files)
  bindings = [*user_bindings, *train_bindings(pool)]
  if len(pool) > 1:
    bindings.append(f"strategy.every = {args.every}")
  bindings.append(f"strategy.profile = {args.profile!r}")
  if cpu and cfg.mesh.host_device_count != args.devices:
    bindings.append(f"mesh.host_device_count = {args.devices}")
  return f"python train.py {files} " + " ".join(f'--gin_bindings="{b}"' for b in bindings)


def launch_line(devices: int, cpu: bool, per_host: int) -> str:
  """How to start the printed command on `devices` devices: one process per host, each with
  all its GPUs (docs/guide/multi-host.md); on CPU one process faking them, or several."""
  if cpu:
    split = f" -d {devices // 2}" if devices % 2 == 0 else ""
    return (f"launch: that command on this host's CPU ({devices} fake devices in one process); "
            f"as 2 processes: python -m moejax.launch -n 2{split} -- followed by it")
  if devices <= per_host:
    return f"launch: that command on one host with {devices} GPUs"
  hosts = -(-devices // per_host)
  return (f"launch on {devices} GPUs, {hosts} hosts of up to {per_host}: srun --nodes={hosts} "
          f"--ntasks-per-node=1 --gpus-per-node={per_host} followed by that command; without "
          f"SLURM, that command on each host with JAX_COORDINATOR_ADDRESS=HOST0:PORT "
          f"JAX_NUM_PROCESSES={hosts} JAX_PROCESS_ID=0..{hosts - 1} (docs/guide/multi-host.md)")


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  gin_files = args.gin_file or [DEFAULT_GIN]
  try:
    cfg = parse_config(gin_files, args.gin_bindings)
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
    if args.every < 1 or args.gpus_per_host < 1:
      raise ConfigError(f"--every={args.every} and --gpus_per_host={args.gpus_per_host} must "
                        "be >= 1.")
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
  fit = sum(r.rejected is None for r in rows)
  best = pool[0]
  cost = next(r for r in rows if r.strategy == best).costs[regimes[0]]
  print(f"best: {best.spec}, {cost.total_s * 1e3:.2f} ms a step under {regimes[0]} load with "
        f"{cost.drop_fraction:.1%} of choices dropped; {fit:,} of {len(rows):,} strategies fit" +
        ("" if args.all else " (the table of all: --all)"))
  print("pool: " + ", ".join(s.spec for s in pool))
  print("why (the pool covers the load regimes; with strategy.every > 0 the trainer switches "
        "among its members as the load changes):")
  print("\n".join(why(rows, pool, args.max_drop, regimes)))
  command = train_command(gin_files, args.gin_bindings, pool, args, cfg, on_cpu(profile))
  print(f"train with: {command}")
  print(launch_line(args.devices, on_cpu(profile), args.gpus_per_host))
  if args.all:
    print(table(rows, regimes))
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
