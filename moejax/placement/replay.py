"""Replay a routing trace through expert-placement policies, using only lagged statistics.

  python -m moejax.replay TRACE.npz --devices N --slots C --policy P|all [--every EVERY]
      [--window WINDOW] [--json OUT.json]

Sources map to devices evenly: source s of W runs on device s*N // W, which needs W % N == 0 or
N % W == 0. Every layer is replayed independently. At step 0 the layout is the static one
(expert e on device e // (E/N)); at every step t > 0 with t % every == 0 the policy is called
with the prediction from finished steps only, `predict(counts[:t], window)[layer]` (mean of the
last `window` steps), and the layout in use; its answer is used from step t on. The layout in
use at step t is evaluated with `flow` on the actual counts of step t: max/mean device load
(median, p90 and mean over steps x layers), tokens whose expert runs off their source device,
and, per decision, experts moved ((expert, device) copies in the new layout that the old one
lacked) and the policy call's wall time. One-copy policies (static, smartmoe) get E/N slots per
device whatever --slots says (E must divide by N); the others get --slots (>= E/N).
"""

from __future__ import annotations

import time

import numpy as np

from moejax.config import ConfigError
from moejax.layout import placement as placement_lib
from moejax.layout.flow import flow, max_over_mean
from moejax.placement.policies import ONE_COPY_POLICIES, POLICIES, CostModel, get_policy, predict


def effective_slots(policy: str, num_experts: int, devices: int, slots: int) -> int:
  if num_experts % devices:
    raise ConfigError(f"replay needs E={num_experts} experts divisible by --devices={devices} "
                      "(the static base layout puts E/N experts on each device).")
  per_dev = num_experts // devices
  if policy in ONE_COPY_POLICIES:
    return per_dev
  if slots < per_dev:
    raise ConfigError(f"--slots={slots} is below E/N={per_dev}; policy {policy!r} needs "
                      f"--slots >= {per_dev}.")
  return slots


def replay(counts: np.ndarray, devices: int, slots: int, policy: str, every: int = 10,
           window: int = 10, cost: CostModel | None = None) -> dict:
  """Replays counts[steps, L, W, E] through one policy; returns the per-policy result dict."""
  counts = np.asarray(counts)
  if counts.ndim != 4:
    raise ConfigError(f"counts must be [steps, layers, sources, experts], got {counts.shape}.")
  if every < 1 or window < 1 or devices < 1:
    raise ConfigError(f"--every={every}, --window={window} and --devices={devices} must be >= 1.")
  steps, layers, sources, experts = counts.shape
  place = get_policy(policy)
  src_dev = placement_lib.source_devices(sources, devices)
  c_eff = effective_slots(policy, experts, devices, slots)
  cost = cost or CostModel()
  current = [placement_lib.static(experts, devices) for _ in range(layers)]
  series = np.zeros((steps, layers))
  predicted = []          # max/mean of each decision's layout on the load it was planned for
  crossing, moved, times = 0, 0, []
  for t in range(steps):
    if t > 0 and t % every == 0:
      pred = predict(counts[:t], window)                      # [L, W, E], finished steps only
      for layer in range(layers):
        t0 = time.perf_counter()
        new = place(pred[layer], current[layer], slots=c_eff, src_dev_W=src_dev, cost=cost,
                   num_devices=devices)
        times.append(time.perf_counter() - t0)
        new.validate(experts)
        predicted.append(max_over_mean(flow(new, pred[layer], src_dev).device_load_N))
        old_NxE = placement_lib.presence(current[layer], experts)
        moved += int((placement_lib.presence(new, experts) & ~old_NxE).sum())
        current[layer] = new
    for layer in range(layers):
      f = flow(current[layer], counts[t, layer], src_dev)
      series[t, layer] = max_over_mean(f.device_load_N)
      crossing += f.crossing
  total = int(counts.sum())
  ms = np.asarray(times) * 1e3
  return {
      "median": float(np.median(series)),
      "predicted_median": float(np.median(predicted)) if predicted else None,
      "predicted_mean": float(np.mean(predicted)) if predicted else None,
      "p90": float(np.percentile(series, 90)),
      "mean": float(np.mean(series)),
      "tokens_crossing": int(crossing),
      "crossing_fraction": crossing / total if total else 0.0,
      "experts_moved": moved,
      "planner_ms_mean": float(ms.mean()) if len(ms) else None,
      "planner_ms_max": float(ms.max()) if len(ms) else None,
      "decisions": len(times),
      "series": series.tolist(),
  }


def policy_names(policy: str) -> list[str]:
  if policy == "all":
    return ["static"] + sorted(p for p in POLICIES if p != "static")
  get_policy(policy)
  return [policy]


def format_table(results: dict) -> str:
  head = (f"{'policy':<10} {'median':>7} {'p90':>7} {'mean':>7} {'pred med':>8} "
          f"{'crossing tokens':>22} "
          f"{'moved':>6} {'ms/dec mean':>11} {'ms/dec max':>10} {'decisions':>9}")
  lines = [head, "-" * len(head)]
  for name, r in results.items():
    cross = f"{r['tokens_crossing']} ({100 * r['crossing_fraction']:.1f}%)"
    ms_mean = "-" if r["planner_ms_mean"] is None else f"{r['planner_ms_mean']:.3f}"
    ms_max = "-" if r["planner_ms_max"] is None else f"{r['planner_ms_max']:.3f}"
    pred = "-" if r["predicted_median"] is None else f"{r['predicted_median']:.3f}"
    lines.append(f"{name:<10} {r['median']:>7.3f} {r['p90']:>7.3f} {r['mean']:>7.3f} {pred:>8} "
                 f"{cross:>22} {r['experts_moved']:>6} {ms_mean:>11} {ms_max:>10} "
                 f"{r['decisions']:>9}")
  return "\n".join(lines)
