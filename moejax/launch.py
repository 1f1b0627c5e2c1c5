"""`python -m moejax.launch -n P [-d D] -- command ...`: starts P processes of one
multi-process job on this machine (library: `moejax.runtime.processes`)."""

from __future__ import annotations

import argparse
import sys

from moejax.runtime.processes import launch


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].split(': ', 1)[-1],
                                   usage="python -m moejax.launch [options] -- command ...")
  parser.add_argument("--processes", "-n", type=int, default=2)
  parser.add_argument("--devices_per_process", "-d", type=int, default=None,
                      help="fake this many CPU devices per process (sets XLA_FLAGS)")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command after --, e.g. -- python train.py")
  if args.processes < 1 or (args.devices_per_process is not None and
                            args.devices_per_process < 1):
    parser.error("--processes and --devices_per_process must be >= 1")
  return launch(command, args.processes, args.devices_per_process)


if __name__ == "__main__":
  sys.exit(main())
