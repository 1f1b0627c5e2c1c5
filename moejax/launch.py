"""`python -m moejax.launch -n P [-d D] -- command ...`: starts P processes of one
multi-process job on this machine (library: `moejax.runtime.processes`)."""

from __future__ import annotations

import argparse
import shutil
import sys

from moejax.runtime.cli import ArgumentParser, fail
from moejax.runtime.processes import launch


def parser() -> ArgumentParser:
  p = ArgumentParser(
      prog="python -m moejax.launch", usage="python -m moejax.launch [options] -- command ...",
      description="Starts P processes of one multi-process JAX job on this machine, connected "
                  "over loopback; passes their output on as it comes, each line (and each "
                  "progress-bar redraw) prefixed with its process index, and if one fails, "
                  "stops the others and names it with its exit code or signal.")
  p.add_argument("--processes", "-n", type=int, default=2,
                      help="How many processes to start (default 2).")
  p.add_argument("--devices_per_process", "-d", type=int, default=None,
                      help="Fake this many CPU devices in each process (sets XLA_FLAGS).")
  p.add_argument("command", nargs=argparse.REMAINDER,
                      help="The command each process runs, after --, e.g. -- python train.py.")
  return p


def main(argv: list[str] | None = None) -> int:
  parser_ = parser()
  args = parser_.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser_.error("give the command after --, e.g. -- python train.py")
  if args.processes < 1 or (args.devices_per_process is not None and
                            args.devices_per_process < 1):
    parser_.error("--processes and --devices_per_process must be >= 1")
  if shutil.which(command[0]) is None:
    return fail(f"command {command[0]!r} not found (not a file, nor on PATH); give the program "
                "to start after --, e.g. -- python train.py.")
  return launch(command, args.processes, args.devices_per_process)


if __name__ == "__main__":
  sys.exit(main())
