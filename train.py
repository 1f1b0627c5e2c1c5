"""Train a GPT-MoE: `python train.py [--gin_file=configs/X.gin ...] [--gin_bindings='a.b = 1' ...]`.

With no flags it runs the embedded default (configs/default.gin) on 8 fake CPU
devices. Thin on purpose: parse gin, build the frozen configs, call the library.
On a cluster run it once per host: `jax.distributed` starts from the environment
(moejax/runtime/distributed.py). Exit codes: 0 done or preempted (SIGTERM/SIGINT: the step
in flight finishes and is saved), 2 bad configuration, no usable checkpoint, a checkpoint of
another model or a run dir in use by another run, 3 too many non-finite steps in a row, 4 a
write failed (a full disk), 130 a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys

from moejax import config as config_lib
from moejax.frontend import DEFAULT_GIN, operative_config, parse_config
from moejax.runtime import xla_flags
from moejax.runtime.cli import ArgumentParser
from moejax.train.faults import DiskErrorNoise, NonFiniteError, RecoveredNoise, WriteError
from moejax.train.preempt import StopRequest

__all__ = ["DEFAULT_GIN", "main", "parse_config"]


def set_xla_flags(host_device_count: int) -> None:
  """Before jax is imported: with no XLA_FLAGS given, set this platform's defaults (CPU:
  `host_device_count` fake devices; GPU: the latency-hiding scheduler, XLA's memory limit and
  the allocator's share of the GPU) and say so."""
  platform = xla_flags.platform_before_init(os.environ, xla_flags.installed_jax_plugins())
  for line in xla_flags.set_defaults(os.environ, platform, host_device_count):
    name = line.split("=")[0]
    print(f"{line} (train.py's default for {platform}; set {name} to replace it)", flush=True)


def quiet_library_noise() -> None:
  """A full disk is reported once, by the `error:` line; orbax's threads would log one
  traceback per array (through the `absl` and `asyncio` loggers). Damage the resume recovers
  from by itself (an unreadable `_CHECKPOINT_METADATA`) is not the user's to act on."""
  import logging

  for name in ("absl", "asyncio"):
    logger = logging.getLogger(name)
    for noise in (DiskErrorNoise, RecoveredNoise):
      if not any(isinstance(f, noise) for f in logger.filters):
        logger.addFilter(noise())


def parser() -> ArgumentParser:
  p = ArgumentParser(
      prog="python train.py",
      description="Trains a GPT-MoE from gin config files and bindings, resuming from the run "
                  "dir's latest checkpoint when it has one; with no flags, the embedded default "
                  "job on 8 fake CPU devices.")
  p.add_argument("--gin_file", action="append", default=None,
                 help=f"A gin config file (repeatable); default: {os.path.relpath(DEFAULT_GIN)}.")
  p.add_argument("--gin_bindings", action="append", default=[],
                 help="A gin binding such as 'train.num_steps = 10' (repeatable); strings take "
                      "quotes, e.g. \"moe.expert_mode = 'fsep'\".")
  return p


def main(argv: list[str] | None = None) -> int:
  quiet_library_noise()
  args = parser().parse_args(argv)
  with StopRequest() as stop:   # from the start: a SIGTERM during start-up also ends in a save
    return _run(args, stop)


def _run(args: argparse.Namespace, stop: StopRequest) -> int:
  try:
    cfg = parse_config(args.gin_file or [DEFAULT_GIN], args.gin_bindings)
    set_xla_flags(cfg.mesh.host_device_count)
    from moejax.runtime import distributed  # imports jax only if the environment is multi-process

    if distributed.maybe_initialize():
      stop.reinstall()   # JAX's preemption notifier took SIGTERM
    import jax

    from moejax.train.balance import describe as describe_balance
    from moejax.train.trainer import train  # imports jax: only after XLA_FLAGS is settled

    main_process = jax.process_index() == 0
    summary = train(cfg, stop=stop, run_files={"operative_config.gin": operative_config()})
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except NonFiniteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  except WriteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 4
  except KeyboardInterrupt:
    print("interrupted; re-run the same command to resume from the latest checkpoint in the "
          "run dir's checkpoints/", file=sys.stderr)
    return 130
  if not main_process:
    return 0
  first, last = summary["first"], summary["last"]
  if summary["preempted"]:
    print(f"stopped by {summary['preempted']}: saved step {summary['saved_step']} in "
          f"{summary['checkpoint_dir']}; re-run the same command to resume")
  elif first and last:
    print(f"steps {summary['start_step']}..{last['step']}: loss {first['loss']:.3f} -> "
          f"{last['loss']:.3f}; run dir {cfg.train.run_dir}")
    if summary["balance"] is not None:
      print(describe_balance(summary["balance"], cfg.planner.policy, cfg.moe.capacity))
  else:
    print(f"nothing to do: the latest checkpoint in {cfg.train.run_dir} is at or past "
          f"train.num_steps={cfg.train.num_steps}. To train further, raise train.num_steps: "
          f"the learning rate then continues its saved schedule (optim.decay_steps="
          f"{summary['decay_steps']}) unless you set optim.decay_steps.")
  return 0


def plain_log_lines() -> None:
  """The trainer's log lines ("warning: ...", "resuming from ...") as they are, on stderr,
  rather than under the "WARNING:moejax:" prefix of the root handler a library installs."""
  import logging

  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(message)s"))
  logger = logging.getLogger("moejax")
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)   # "resuming from step N" too
  logger.propagate = False


if __name__ == "__main__":
  plain_log_lines()
  sys.exit(main())
