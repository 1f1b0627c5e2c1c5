"""`python -m moejax.workloads --out T.npz --kind KIND` (lognormal, zipf, collapse,
early_collapse, drift_bursts): writes a synthetic routing trace and prints its step-to-step
statistics (library: `moejax.placement.synthetic`, `moejax.placement.drift`).

  python -m moejax.workloads --out benchmarks/traces/drift_bursts.npz --kind drift_bursts \
      --steps 600
"""

from __future__ import annotations

import argparse

from moejax.config import ConfigError
from moejax.placement.drift import drift_bursts_trace, step_change
from moejax.placement.synthetic import KINDS, save_trace, synthetic_trace


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m moejax.workloads",
                               description="Write a synthetic routing trace (.npz).")
  ap.add_argument("--out", required=True, help="output .npz path")
  ap.add_argument("--kind", default="lognormal", choices=KINDS + ("drift_bursts",))
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
  ap.add_argument("--collapse_steps", type=int, default=3,
                  help="early_collapse: steps from near-uniform routing to fully collapsed")
  ap.add_argument("--burst_rate", type=float, default=0.01,
                  help="drift_bursts: chance per step and layer that a burst starts")
  a = ap.parse_args(argv)
  try:
    if a.kind == "drift_bursts":
      trace = drift_bursts_trace(a.steps, a.layers, a.sources, a.experts, a.top_k,
                                 a.tokens_per_source, a.sigma, burst_rate=a.burst_rate,
                                 seed=a.seed)
    else:
      trace = synthetic_trace(a.steps, a.layers, a.sources, a.experts, a.top_k,
                              a.tokens_per_source, a.kind, a.sigma, a.zipf_a, a.corr, a.seed,
                              collapse_steps=a.collapse_steps)
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  save_trace(a.out, trace)
  print(f"wrote {a.out}: {a.kind} counts{list(trace['counts'].shape)} top_k={a.top_k}")
  stats = step_change(trace["counts"])
  print("hot (8 largest) experts' share change step to step: median "
        f"{100 * stats['hot_change_median']:.1f}%, p90 {100 * stats['hot_change_p90']:.1f}%; "
        f"consecutive-step load correlation {stats['consecutive_corr']:.3f}; hottest expert "
        f"{100 * stats['top_share_mean']:.1f}% on average; "
        f"{stats['choices_per_step_layer']} choices per step and layer")
  if "bursts" in trace:
    b = trace["bursts"]
    print(f"{len(b)} bursts (x3 share), {int(b[:, 3].sum())} burst steps of "
          f"{trace['counts'].shape[0] * trace['counts'].shape[1]} step-layers")


if __name__ == "__main__":
  main()
