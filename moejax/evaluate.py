"""`python -m moejax.evaluate RUN_DIR [--data PATH]`: the loss and perplexity of a run's latest
intact checkpoint on its held-out split (or given data), and how routing went over it: one line
on stdout and a JSON file (library: `moejax.train.evaluation`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import typing

from moejax import config as config_lib
from moejax.config import Config, ConfigError
from moejax.runtime import xla_flags
from moejax.runtime.cli import ArgumentParser, fail

JSON_NAME = "eval.json"


def parser() -> ArgumentParser:
  p = ArgumentParser(
      prog="python -m moejax.evaluate",
      description="Evaluates a run dir's latest intact checkpoint: the loss and perplexity on "
                  "its held-out split (or the data given), with the trainer's own eval step, "
                  "and the routing over that data (dropped choices, the busiest device over "
                  "the mean); prints one line and writes a JSON file.")
  p.add_argument("run_dir", help="A run dir that trained, or one that `python -m moejax.convert "
                                 "from_hf` wrote.")
  p.add_argument("--data", default=None,
                 help="Data to evaluate on, read as data.path is (a prepared directory, a "
                      ".bin/.npy token file or a text file); default: the run's own.")
  p.add_argument("--split", choices=("val", "train"), default="val",
                 help="Which split of the data to read (default val, the held-out one).")
  p.add_argument("--batches", type=int, default=0,
                 help="How many batches of the run's data.global_batch_size to read, in the "
                      "order the trainer's evaluation reads them (default 0: the whole split).")
  p.add_argument("--mesh", default=None,
                 help="The data,expert,model sizes to evaluate on, e.g. 1,1,1 on one device "
                      "(default: the run's strategy).")
  p.add_argument("--json", default=None,
                 help=f"Where to write the JSON (default RUN_DIR/{JSON_NAME}).")
  return p


def run_config(run_dir: str) -> Config:
  """The Config a run dir records (config.json), JAX-free."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.isfile(path):
    raise ConfigError(f"RUN_DIR {run_dir!r} has no config.json; give a run dir that trained or "
                      "that `python -m moejax.convert from_hf` wrote.")
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path} does not read as JSON ({e}); give a run dir that trained.") from None
  parts = {}
  hints = typing.get_type_hints(Config)
  for field in dataclasses.fields(Config):
    cls, values = hints[field.name], dict(saved.get(field.name) or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"{path} has {field.name}.{unknown[0]}, which this moejax does not know; "
                        "evaluate with the moejax that trained the run.")
    if field.name == "strategy" and "pool" in values:
      values["pool"] = tuple(values["pool"])
    parts[field.name] = cls(**values)
  return Config(**parts)


def with_mesh(cfg: Config, text: str) -> Config:
  """`cfg` on the data,expert,model sizes of --mesh `text` (its strategy pool dropped)."""
  try:
    sizes = tuple(int(p) for p in text.split(","))
  except ValueError:
    sizes = ()
  if len(sizes) != 3 or any(s < 1 for s in sizes):
    raise ConfigError(f"--mesh {text!r}: give data,expert,model sizes, e.g. 1,1,1.")
  mesh = dataclasses.replace(cfg.mesh, data=sizes[0], expert=sizes[1], model=sizes[2],
                             host_device_count=math.prod(sizes) * cfg.mesh.stage)
  return dataclasses.replace(cfg, mesh=mesh, strategy=dataclasses.replace(cfg.strategy, pool=()))


def set_xla_flags(cfg: Config, command: str = "evaluate") -> None:
  """As train.py: with no XLA_FLAGS, the CPU devices the run's mesh needs (said on stderr:
  stdout carries the result)."""
  platform = xla_flags.platform_before_init(os.environ, xla_flags.installed_jax_plugins())
  for line in xla_flags.set_defaults(os.environ, platform, cfg.mesh.host_device_count):
    name = line.split("=")[0]
    print(f"{line} ({command}'s default for {platform}; set {name} to replace it)",
          file=sys.stderr, flush=True)


def mesh_devices(cfg: Config) -> list:
  """The first devices, as many as --mesh asks for (a host with more evaluates on fewer)."""
  import jax

  need, have = cfg.mesh.host_device_count, jax.devices()
  if need > len(have):
    raise ConfigError(f"--mesh asks for {need} devices but there are {len(have)}; give a mesh "
                      f"of at most {len(have)}.")
  return have[:need]


def line(result, run_dir: str, json_path: str) -> str:
  r = result
  return (f"step {r.step} of {run_dir}: loss {r.loss:.4f}, perplexity {r.perplexity:.2f} on the "
          f"{r.split} split of {r.data} ({r.batches} batches, {r.tokens:,} tokens, "
          f"{r.strategy}); routing: {r.dropped_fraction:.2%} of choices dropped, the busiest "
          f"device {r.max_over_mean_load:.2f}x the mean routed, "
          f"{r.realised_max_over_mean:.2f}x computed (worst layer); {json_path}")


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  json_path = args.json or os.path.join(args.run_dir, JSON_NAME)
  try:
    cfg = run_config(args.run_dir)
    if args.data is not None:
      cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=args.data))
    if args.mesh is not None:
      cfg = with_mesh(cfg, args.mesh)
    cfg = cfg.validate()
    set_xla_flags(cfg)
    from moejax.train import evaluation  # imports jax: after XLA_FLAGS is settled
    from moejax.train.lock import RunDirLock

    lock = RunDirLock(args.run_dir)
    for warning in lock.acquire():
      print(f"warning: {warning}", file=sys.stderr)
    try:
      tokens = evaluation.split_tokens(cfg, args.split)
      result = evaluation.evaluate(cfg, args.run_dir, tokens, args.batches, args.split,
                                   devices=mesh_devices(cfg) if args.mesh else None,
                                   progress=sys.stderr.isatty())
      for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
      with open(json_path, "w") as f:
        json.dump({"run_dir": args.run_dir, **result.to_dict()}, f, indent=1)
    finally:
      lock.release()
  except config_lib.ConfigError as e:
    return fail(str(e))
  print(line(result, args.run_dir, json_path))
  return 0


if __name__ == "__main__":
  sys.exit(main())
