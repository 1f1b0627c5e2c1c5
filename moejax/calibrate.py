"""`python -m moejax.calibrate --out profile.json`: fits a hardware profile to this machine by
micro-benchmarks (library: `moejax.strategy.profile_fit`)."""

from __future__ import annotations

import os

from moejax.runtime.cli import ArgumentParser
from moejax.strategy.profile_fit import calibrate, save


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="python -m moejax.calibrate",
                     description="Fits a hardware profile to this machine by micro-benchmarks "
                                 "(matmuls, an elementwise op, all_to_all and psum) for "
                                 "python -m moejax.plan --profile; takes minutes.")
  p.add_argument("--out", default="profile.json",
                 help="The JSON file to write the profile to (default profile.json).")
  p.add_argument("--repeats", type=int, default=15,
                 help="Timed repeats of each micro-benchmark (default 15).")
  return p


def main(argv=None) -> int:
  parser_ = parser()
  args = parser_.parse_args(argv)
  where = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(where) or not os.access(where, os.W_OK):   # before minutes of timing
    parser_.error(f"--out={args.out}: cannot write into {where}; make it or choose another path")
  if args.repeats < 1:
    parser_.error(f"--repeats={args.repeats} must be >= 1")
  profile = calibrate(repeats=args.repeats)
  save(profile, args.out)
  for key, value in profile.to_dict().items():
    print(f"{key:>22}: {value:.4g}" if isinstance(value, float) else f"{key:>22}: {value}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
