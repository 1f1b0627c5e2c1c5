"""`python -m moejax.calibrate --out profile.json`: fits a hardware profile to this machine by
micro-benchmarks (library: `moejax.strategy.calibrate`)."""

from __future__ import annotations

import argparse

from moejax.strategy.calibrate import calibrate, save


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m moejax.calibrate",
                                   description=__doc__.splitlines()[0].split(": ", 1)[-1])
  parser.add_argument("--out", default="profile.json")
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args(argv)
  profile = calibrate(repeats=args.repeats)
  save(profile, args.out)
  for key, value in profile.to_dict().items():
    print(f"{key:>22}: {value:.4g}" if isinstance(value, float) else f"{key:>22}: {value}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
