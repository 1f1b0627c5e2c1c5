"""`python -m moejax.workloads --out T.npz --kind lognormal|zipf|collapse`: writes a synthetic
routing trace (library: `moejax.placement.workloads`)."""

from __future__ import annotations

import argparse

from moejax.config import ConfigError
from moejax.placement.workloads import KINDS, save_trace, synthetic_trace


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m moejax.workloads",
                               description="Write a synthetic routing trace (.npz).")
  ap.add_argument("--out", required=True, help="output .npz path")
  ap.add_argument("--kind", default="lognormal", choices=KINDS)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--sources", type=int, default=16)
  ap.add_argument("--experts", type=int, default=32)
  ap.add_argument("--top_k", type=int, default=2)
  ap.add_argument("--tokens_per_source", type=int, default=2048)
  ap.add_argument("--sigma", type=float, default=1.0)
  ap.add_argument("--zipf_a", type=float, default=1.1)
  ap.add_argument("--corr", type=float, default=0.8)
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  try:
    trace = synthetic_trace(a.steps, a.layers, a.sources, a.experts, a.top_k,
                            a.tokens_per_source, a.kind, a.sigma, a.zipf_a, a.corr, a.seed)
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  save_trace(a.out, trace)
  print(f"wrote {a.out}: {a.kind} counts{list(trace['counts'].shape)} top_k={a.top_k}")


if __name__ == "__main__":
  main()
