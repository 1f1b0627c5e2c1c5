"""The capacity fsep needs under planned and under adaptive token shares, on a routing trace.

For every step after the first decision and every layer, the layout the fsep planner chose
(every --every steps from the last --window finished steps, as `python -m moejax.replay`
does) routes the step's counts, summed per device (one source per device, as in the layer):
by its planned shares (`placement.split_loads`) and by shares re-levelled on the step's own
counts (`adaptive.split_adaptive`, a device's kept rows within its own pair's buffer at
factor 1, per slot or pooled as the mode is, as the layer keeps them). For each, the busiest
device's load over the mean and the smallest capacity factor with which each capacity mode
(`moejax.layout.capacity`: 'slot' per (source, slot), 'device' pooled per (source, device))
drops at most --max_drop of the step's choices. Then, for each --factors value, the share of
all choices each mode drops at that factor, with the layouts planned for it (the planner's
`capacity_factor`, as the trainer passes it). Host arithmetic
only; no timing.

  python -m benchmarks.placement.adaptive_capacity benchmarks/traces/drift_bursts.npz --devices 8 \
      --slots 8 --json benchmarks/placement/results/adaptive_capacity_drift_bursts_N8.json
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.common import command, default_cost, start, write_result
from moejax.layout import adaptive, capacity, host_layout as placement_lib
from moejax.layout.flow import max_over_mean
from moejax.placement.fsep import FsepOptions
from moejax.placement.policies import get_policy, predict
from moejax.placement.synthetic import load_trace

RULES = ("planned", "adaptive")


def _steps(counts, devices, slots, every, window, factor=None):
  """(step counts [N, E] summed per device, the layout in use) for every step and layer from
  the first decision on, the layouts planned as replay plans them."""
  steps, layers, sources, experts = counts.shape
  src = placement_lib.source_devices(sources, devices)
  place = get_policy("fsep")
  static = placement_lib.static(experts, devices)
  current = [None] * layers
  for t in range(every, steps):
    if t % every == 0:
      pred = predict(counts[:t], window)
      for layer in range(layers):
        current[layer] = place(pred[layer], static, slots=slots, src_dev_W=src,
                               cost=default_cost(), num_devices=devices,
                               samples_stepsxWxE=counts[max(0, t - window):t, layer],
                               options=FsepOptions(capacity_factor=factor))
    for layer in range(layers):
      yield (placement_lib.device_counts(counts[t, layer], src, devices).astype(np.int64),
             current[layer])


def measure(counts: np.ndarray, top_k: int, devices: int, slots: int, every: int, window: int,
            max_drop: float) -> dict:
  """Per-step [steps x layers] series of max/mean and of each mode's smallest factor."""
  out = {rule: {"max_over_mean": [], **{m: [] for m in capacity.MODES}} for rule in RULES}
  for c_NxE, p in _steps(counts, devices, slots, every, window):
    num_tokens = int(c_NxE.sum(1).max()) // top_k
    keep = adaptive.balanced_cap(c_NxE, p)
    loads = {"planned": dict.fromkeys(capacity.MODES, placement_lib.split_loads(
                 p, c_NxE, np.arange(devices))),
             "adaptive": {m: adaptive.split_adaptive(p, c_NxE, keep, pooled=m == "device")
                          for m in capacity.MODES}}
    for rule, by_mode in loads.items():
      out[rule]["max_over_mean"].append(max_over_mean(
          by_mode["slot"].reshape(devices, devices, slots).sum((0, 2))))
      for mode, loads_NxS in by_mode.items():
        out[rule][mode].append(capacity.smallest_factor(mode, loads_NxS, slots, num_tokens,
                                                        top_k, max_drop))
  return out


def drops(counts: np.ndarray, top_k: int, devices: int, slots: int, every: int, window: int,
          factor: float) -> dict:
  """Share of all choices dropped by each rule and mode at capacity factor `factor`."""
  dropped = {rule: dict.fromkeys(capacity.MODES, 0) for rule in RULES}
  total = 0
  for c_NxE, p in _steps(counts, devices, slots, every, window, factor):
    num_tokens = int(c_NxE.sum(1).max()) // top_k
    total += int(c_NxE.sum())
    keep = adaptive.balanced_cap(c_NxE, p)
    planned = placement_lib.split_loads(p, c_NxE, np.arange(devices))
    for mode in capacity.MODES:
      cap = capacity.rows(mode, num_tokens, top_k, devices, slots, factor)
      loads = {"planned": planned,
               "adaptive": adaptive.split_adaptive(p, c_NxE, keep, pooled=mode == "device")}
      for rule, loads_NxS in loads.items():
        dropped[rule][mode] += capacity.dropped(mode, loads_NxS, slots, cap)
  return {rule: {mode: d / total for mode, d in r.items()} for rule, r in dropped.items()}


def summary(series: dict) -> dict:
  return {rule: {key: {"median": float(np.median(v)), "p90": float(np.percentile(v, 90)),
                       "max": float(np.max(v))} for key, v in r.items()}
          for rule, r in series.items()}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.placement.adaptive_capacity")
  ap.add_argument("trace")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--every", type=int, default=10)
  ap.add_argument("--window", type=int, default=10)
  ap.add_argument("--max_drop", type=float, default=0.01)
  ap.add_argument("--factors", type=float, nargs="*", default=[1.25, 2.0])
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  data = load_trace(a.trace)
  top_k = int(data.get("top_k", 2))
  res = summary(measure(data["counts"], top_k, a.devices, a.slots, a.every, a.window,
                        a.max_drop))
  print(f"{a.trace}: devices={a.devices} slots={a.slots} every={a.every} window={a.window}; "
        f"median / p90 / max over steps x layers; cf = smallest factor dropping <= "
        f"{a.max_drop:.0%}")
  print(f"{'shares':<9} {'max/mean':>23} {'cf slot':>23} {'cf device':>23}")
  for rule, r in res.items():
    cells = ["{median:.3f} / {p90:.3f} / {max:.3f}".format(**r[k])
             for k in ("max_over_mean", "slot", "device")]
    print(f"{rule:<9} " + " ".join(f"{c:>23}" for c in cells))
  at = {}
  for factor in a.factors:
    at[factor] = drops(data["counts"], top_k, a.devices, a.slots, a.every, a.window, factor)
    print(f"cf {factor}: dropped " + "; ".join(
        f"{rule} slot {r['slot']:.2%} device {r['device']:.2%}" for rule, r in at[factor].items()))
  if a.json:
    write_result({"trace": a.trace, "devices": a.devices, "slots": a.slots, "every": a.every,
                  "window": a.window, "max_drop": a.max_drop, "top_k": top_k, **res,
                  "dropped_at": {str(k): v for k, v in at.items()},
                  "command": command("placement.adaptive_capacity", argv)}, a.json)


if __name__ == "__main__":
  start()
  main()
