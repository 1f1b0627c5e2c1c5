"""Replay a routing trace through expert-placement policies, using only lagged statistics.

  python -m moejax.replay TRACE.npz --devices N --slots C --policy P|all [--every EVERY]
      [--window WINDOW] [--json OUT.json]

Sources map to devices evenly: source s of W runs on device s*N // W, which needs W % N == 0 or
N % W == 0. Every layer is replayed independently. As in the trainer, at step 0 the layout is
the static one (expert e on device e // (E/N)) for one-copy policies and the round-robin one (slot s
hosts expert s mod E, even shares) for the others, and the first plan comes from the first
finished step (the re-planner's cold start): at step 1 and at every step t > 0 with
t % every == 0 the policy is called with the prediction from finished steps only,
`predict(counts[:t], window)[layer]` (mean of the last `window` steps), and the layout in use;
its answer is used from step t on. The layout in
use at step t is evaluated with `flow` on the actual counts of step t: max/mean device load
(median, p90 and mean over steps x layers), tokens whose expert runs off their source device,
what the program pays (per capacity mode the smallest factor with <= 1% of the choices dropped,
and the exchange's bytes: `moejax.placement.buffers`), and, per decision, experts moved
((expert, device) copies in the new layout that the old one lacked) and the policy call's wall
time. The policy also gets the window's steps themselves (`samples_stepsxWxE`), for a planner that
plans for their spread. One-copy policies (static, smartmoe) get E/N slots per device whatever
--slots says (E must divide by N); the others get --slots (>= E/N).

`replay_trainer` replays through the trainer's own re-planner instead (`OnlinePlanner`: its
`due` / `propose` / `observe` calls, its options and adaptive rule), with the loop's one-step-late
reading of the metrics: the layouts a training run on that routing would have used.

`oracle` replays the fsep planner given each step's own counts (every step, no lag): a bound
no lagged planner reaches; `with_regret` adds each policy's distance from it. The
`window_oracle` row (`replay(..., lookahead=True)`) gives each fsep decision the `every` steps
it will serve: the per-step noise floor of a layout held for `every` steps.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from moejax.config import ConfigError
from moejax.layout import host_layout as placement_lib
from moejax.layout.flow import flow, max_over_mean
from moejax.layout.tables import round_robin_placement
from moejax.placement import pricing
from moejax.placement.buffers import BufferTally
from moejax.placement.policies import ONE_COPY_POLICIES, POLICIES, CostModel, get_policy, predict
from moejax.placement.replanner import OnlinePlanner


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
           window: int = 10, *, cost: CostModel, options=None,
           lookahead: bool = False, shares: str = "planned", adaptive: bool = False) -> dict:
  """Replays counts[steps, L, W, E] through one policy (with its `options` dataclass, or its
  defaults); returns the per-policy result dict. `shares="adaptive"`: fsep layouts split
  each step's tokens by shares re-levelled from that step's counts (`moejax.layout.adaptive`)
  instead of the planned ones. `adaptive` (planner.adaptive): a candidate after every finished
  step, kept where its priced gain over `every` steps beats its migration
  (`moejax.placement.pricing`). As the trainer, the first decision comes after step 1 (one
  finished step), then every `every` steps. `lookahead` (the `window_oracle`
  row): each decision, from step 0 on, is given the `every` steps it will serve (their mean
  and the steps, not which comes when) instead of the finished ones: what a layout held for `every`
  steps can reach when only the per-step noise inside them is unknown."""
  counts = np.asarray(counts)
  if counts.ndim != 4:
    raise ConfigError(f"counts must be [steps, layers, sources, experts], got {counts.shape}.")
  if every < 1 or window < 1 or devices < 1:
    raise ConfigError(f"--every={every}, --window={window} and --devices={devices} must be >= 1.")
  check_shares(shares)
  steps, layers, sources, experts = counts.shape
  place = get_policy(policy)
  if options is not None:
    place = functools.partial(place, options=options)
  src_dev = placement_lib.source_devices(sources, devices)
  c_eff = effective_slots(policy, experts, devices, slots)
  start = (placement_lib.static(experts, devices) if policy in ONE_COPY_POLICIES
           else round_robin_placement(experts, devices, c_eff))
  current = [start for _ in range(layers)]
  tally = BufferTally(cost)
  series = np.zeros((steps, layers))
  predicted = []          # after each decision: max/mean of the layout in use, predicted load
  crossing, moved, times = 0, 0, []
  moves = pricing.moves_weights(policy)
  # What the program pays, priced by the cost model: the busiest device's expert compute over
  # steps x layers and the migrations' seconds.
  priced = {"migrated_bytes": 0, "migration_s": 0.0, "switches": 0, "busiest_compute_s": 0.0}
  for t in range(steps):
    # A decision after the first finished step (the trainer's cold start), then every `every`
    # steps; adaptive: a candidate after every step, kept only where its gain over `every`
    # steps beats its migration.
    if (t > 0 or lookahead) and (t % every == 0 or adaptive or (t == 1 and not lookahead)):
      seen = counts[t:t + every] if lookahead else counts[max(0, t - window):t]
      pred = seen.mean(0) if lookahead else predict(seen, window)   # [L, W, E]
      for layer in range(layers):
        t0 = time.perf_counter()
        new = place(pred[layer], current[layer], slots=c_eff, src_dev_W=src_dev, cost=cost,
                    num_devices=devices, samples_stepsxWxE=seen[:, layer])
        times.append(time.perf_counter() - t0)
        new.validate(experts)
        # The trainer's rule (`pricing.decide`): a layout that routes as the current one does is
        # not switched to; under adaptive, past the cold start, nor one whose switch does not
        # pay over `every` steps.
        d = pricing.decide(current[layer], new, pred[layer], cost, moves_weights=moves,
                           horizon=every if adaptive and t > 1 else None,
                           totals_stepsxE=seen[:, layer].sum(1) if adaptive else None)
        if d is not None:
          moved += d.price.moved
          priced["migrated_bytes"] += d.price.moved_bytes
          priced["migration_s"] += d.price.move_s
          priced["switches"] += 1
          current[layer] = new
        planned = flow(held(current[layer], shares), pred[layer], src_dev)
        predicted.append(max_over_mean(planned.device_load_N))
    busiest_s, cross = _evaluate(current, counts[t], src_dev, shares, cost, tally,
                                 series[t])
    priced["busiest_compute_s"] += busiest_s
    crossing += cross
  return {**_result(series, predicted, crossing, int(counts.sum()), moved, times, tally),
          **priced}


def _evaluate(current: list, counts_LxWxE: np.ndarray, src_dev: np.ndarray, shares: str,
              cost: CostModel, tally: BufferTally, out_L: np.ndarray) -> tuple[float, int]:
  """Routes one step's actual counts through the layouts in use: writes each layer's max/mean
  device load into `out_L`, adds the buffers to `tally`; returns (the busiest devices' priced
  compute summed over layers, the rows sent off their device)."""
  busiest_s, crossing = 0.0, 0
  for layer, p in enumerate(current):
    f = flow(held(p, shares), counts_LxWxE[layer], src_dev)
    out_L[layer] = max_over_mean(f.device_load_N)
    busiest_s += cost.compute_s(float(np.max(f.device_load_N)))
    crossing += f.crossing
    tally.add(held(p, shares), counts_LxWxE[layer], src_dev, f.crossing)
  return busiest_s, crossing


def replay_trainer(counts: np.ndarray, planner: OnlinePlanner, slots: int, *,
                   fresh: bool = False, lag: int = 0, shares: str = "planned") -> dict:
  """Replays counts[steps, L, W, E] through the trainer's own re-planner (`planner`, as
  `moejax.train.pool.online_planner` builds it: the config's policy, options, adaptive rule
  and capacity) with the trainer's loop around it: before step t the planner has observed the
  steps up to t - 2 (t - 1 with `fresh`, planner.fresh), since the loop reads a step's
  metrics after dispatching the next; a re-plan due before t (`planner.due(t)`) is proposed
  then and its layout used from step t + `lag` on (planner.lag; plans pending meanwhile are
  chained, as `moejax.train.plan_ahead` chains them). Trace source s runs on device
  s*N // W, so W must divide by N. Not modelled: the loop also reads a step's metrics at once
  before an evaluation or a checkpoint save. Returns `replay`'s result dict, `decisions`
  counting layer proposals and `planner_ms_*` per layer, with `switched`: [step the layout
  is used from, layer, experts moved] per switch, as the trainer's layout_switch events."""
  counts = np.asarray(counts)
  steps, layers, sources, experts = counts.shape
  n = planner.num_devices
  if sources % n:
    raise ConfigError(f"replay_trainer needs the trace's {sources} sources to divide by the "
                      f"planner's {n} devices, as a training run's data x expert rows do.")
  check_shares(shares)
  # The trace holds sources expert-major (s on device s*N // W); the trainer hands the planner
  # (data, expert) row-major counts: source r*N + d is data row r on device d.
  rows = sources // n
  trainer_order = counts.reshape(steps, layers, n, rows, experts).transpose(0, 1, 3, 2, 4)
  trainer_order = trainer_order.reshape(steps, layers, sources, experts)
  src_dev = placement_lib.source_devices(sources, n)
  one_copy = planner.cfg.policy in ONE_COPY_POLICIES
  start = (placement_lib.static(experts, n) if one_copy
           else round_robin_placement(experts, n, effective_slots("fsep", experts, n, slots)))
  current = [start] * layers
  tally = BufferTally(planner.cost)
  series = np.zeros((steps, layers))
  predicted, times, pending = [], [], []     # pending: (apply before step, placements)
  switched = []
  priced = {"migrated_bytes": 0, "migration_s": 0.0, "switches": 0, "busiest_compute_s": 0.0}
  crossing, moved, seen = 0, 0, 0
  for t in range(steps):
    # The loop reads step t - 1's metrics before step t only with planner.fresh.
    while seen < t - (0 if fresh else 1):
      planner.observe(trainer_order[seen])
      seen += 1
    if planner.due(t):
      basis = pending[-1][1] if pending else current
      tick = time.perf_counter()
      new, switches = planner.propose(basis)
      times.extend([(time.perf_counter() - tick) / layers] * layers)
      for sw in switches:
        switched.append([t + lag, sw.layer, sw.experts_moved])
        moved += sw.experts_moved
        priced["migrated_bytes"] += sw.moved_bytes
        priced["migration_s"] += sw.move_s
      priced["switches"] += len(switches)
      pending.append((t + lag, new))
      mean_LxNxE = sum(planner.history) / len(planner.history)
      predicted.extend(max_over_mean(flow(held(p, shares), pred, np.arange(n)).device_load_N)
                       for p, pred in zip(new, mean_LxNxE))
    while pending and pending[0][0] <= t:
      current = pending.pop(0)[1]
    busiest_s, cross = _evaluate(current, counts[t], src_dev, shares, planner.cost, tally,
                                 series[t])
    priced["busiest_compute_s"] += busiest_s
    crossing += cross
  return {**_result(series, predicted, crossing, int(counts.sum()), moved, times, tally),
          **priced, "switched": switched}


SHARES = ("planned", "adaptive")


def check_shares(shares: str) -> None:
  if shares not in SHARES:
    raise ConfigError(f"--shares={shares!r} is unknown; choose one of {SHARES}.")


def held(p: placement_lib.Placement, shares: str) -> placement_lib.Placement:
  """The layout as the router applies it: fsep ("split") layouts re-level their shares every
  step under shares="adaptive"; one-copy and shadow layouts have nothing to split."""
  if shares == "adaptive" and p.routing == "split":
    return dataclasses.replace(p, routing="adaptive")
  return p


def _result(series, predicted, crossing, total, moved, times, tally) -> dict:
  ms = np.asarray(times) * 1e3
  return {
      **tally.result(),
      "median": float(np.median(series)),
      "predicted_median": float(np.median(predicted)) if predicted else None,
      "predicted_mean": float(np.mean(predicted)) if predicted else None,
      "p90": float(np.percentile(series, 90)),
      "p99": float(np.percentile(series, 99)),
      "mean": float(np.mean(series)),
      "tokens_crossing": int(crossing),
      "crossing_fraction": crossing / total if total else 0.0,
      "experts_moved": moved,
      "planner_ms_mean": float(ms.mean()) if len(ms) else None,
      "planner_ms_max": float(ms.max()) if len(ms) else None,
      "decisions": len(times),
      "series": series.tolist(),
  }


def oracle(counts: np.ndarray, devices: int, slots: int, *, cost: CostModel,
           options=None, shares: str = "planned") -> dict:
  """The fsep planner given each step's own counts, every step (what no lagged planner can
  know): the same result dict as `replay`; experts moved counts every step's change."""
  counts = np.asarray(counts)
  steps, layers, sources, experts = counts.shape
  place = get_policy("fsep")
  if options is not None:
    place = functools.partial(place, options=options)
  src_dev = placement_lib.source_devices(sources, devices)
  c_eff = effective_slots("fsep", experts, devices, slots)
  current = [round_robin_placement(experts, devices, c_eff) for _ in range(layers)]
  tally = BufferTally(cost)
  series = np.zeros((steps, layers))
  crossing, moved, times = 0, 0, []
  for t in range(steps):
    for layer in range(layers):
      t0 = time.perf_counter()
      new = place(counts[t, layer].astype(np.float64), current[layer], slots=c_eff,
                  src_dev_W=src_dev, cost=cost, num_devices=devices)
      times.append(time.perf_counter() - t0)
      old_NxE = placement_lib.presence(current[layer], experts)
      moved += int((placement_lib.presence(new, experts) & ~old_NxE).sum())
      current[layer] = new
      f = flow(held(new, shares), counts[t, layer], src_dev)
      series[t, layer] = max_over_mean(f.device_load_N)
      crossing += f.crossing
      tally.add(held(new, shares), counts[t, layer], src_dev, f.crossing)
  return _result(series, [], crossing, int(counts.sum()), moved, times, tally)


def with_regret(results: dict, bound: dict) -> dict:
  """Each policy's median / p90 / p99 over the oracle's, and the mean over steps x layers of
  its per-step max/mean less the oracle's (`regret_*`)."""
  ref = np.asarray(bound["series"])
  for r in results.values():
    for key in ("median", "p90", "p99"):
      r[f"regret_{key}"] = r[key] - bound[key]
    r["regret_mean"] = float(np.mean(np.asarray(r["series"]) - ref))
  return results


def policy_names(policy: str) -> list[str]:
  if policy == "all":
    return ["static"] + sorted(p for p in POLICIES if p != "static")
  get_policy(policy)
  return [policy]


def format_table(results: dict) -> str:
  """One row per policy (an `oracle` entry last, when given); `regret` = median / p90 over
  the oracle's, when `with_regret` added them."""
  head = (f"{'policy':<13} {'median':>7} {'p90':>7} {'p99':>7} {'mean':>7} {'pred med':>8} "
          f"{'regret med/p90':>14} {'crossing tokens':>22} "
          f"{'moved':>6} {'ms/dec mean':>11} {'ms/dec max':>10} {'decisions':>9}")
  lines = [head, "-" * len(head)]
  for name, r in results.items():
    cross = f"{r['tokens_crossing']} ({100 * r['crossing_fraction']:.1f}%)"
    ms_mean = "-" if r["planner_ms_mean"] is None else f"{r['planner_ms_mean']:.3f}"
    ms_max = "-" if r["planner_ms_max"] is None else f"{r['planner_ms_max']:.3f}"
    pred = "-" if r["predicted_median"] is None else f"{r['predicted_median']:.3f}"
    regret = (f"{r['regret_median']:+.3f}/{r['regret_p90']:+.3f}" if "regret_median" in r
              else "-")
    lines.append(f"{name:<13} {r['median']:>7.3f} {r['p90']:>7.3f} {r['p99']:>7.3f} "
                 f"{r['mean']:>7.3f} {pred:>8} {regret:>14} {cross:>22} {r['experts_moved']:>6} "
                 f"{ms_mean:>11} {ms_max:>10} {r['decisions']:>9}")
  return "\n".join(lines)
