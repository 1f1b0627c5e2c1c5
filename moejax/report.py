"""PNG plots of a run's metrics.jsonl and of replay results.

  python -m moejax.report RUN_DIR [--replay REPLAY.json ...] [--out DIR]

Writes expert_load_layer{L}.png, device_load.png, loss.png and replay_<stem>.png (default
into RUN_DIR/plots/) and prints their paths. matplotlib is imported lazily (extra `plot`).
"""

from __future__ import annotations

import json
import os

import numpy as np

from moejax.runtime.cli import ArgumentParser, fail

NO_MATPLOTLIB = "moejax.report needs matplotlib: pip install -e '.[plot]'"


def load_metrics(path: str) -> dict:
  """Splits metrics.jsonl into step, eval and layout-switch records, each sorted by step.

  Lines that do not parse (or lack an integer step) are skipped; of records repeating a
  step (per layer for switches) the last one is kept.
  """
  steps, evals, switches = {}, {}, {}
  with open(path) as f:
    for line in f:
      try:
        rec = json.loads(line)
      except ValueError:
        continue
      if not isinstance(rec, dict) or type(rec.get("step")) is not int:
        continue
      if rec.get("event") == "layout_switch":
        switches[(rec["step"], rec.get("layer"))] = rec
      elif "eval_loss" in rec:
        evals[rec["step"]] = rec
      elif "loss" in rec:
        steps[rec["step"]] = rec
  by_step = lambda recs: sorted(recs.values(), key=lambda r: r["step"])
  return {"steps": by_step(steps), "evals": by_step(evals), "switches": by_step(switches)}


def _pyplot():
  try:
    import matplotlib
  except ImportError:
    raise SystemExit(NO_MATPLOTLIB) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _step_axis(ax, label: str = "step") -> None:
  from matplotlib.ticker import MaxNLocator
  ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
  ax.set_xlabel(label)


def _save(fig, path: str) -> str:
  fig.savefig(path, dpi=120)
  _pyplot().close(fig)
  return path


def _layer_series(steps: list[dict], key: str) -> dict[int, tuple[list, list]]:
  """{layer: (steps, values of `key`)} over the step records' MoE entries."""
  series: dict[int, tuple[list, list]] = {}
  for rec in steps:
    for moe in rec.get("moe") or []:
      xs, ys = series.setdefault(moe["layer"], ([], []))
      xs.append(rec["step"])
      ys.append(moe[key])
  return dict(sorted(series.items()))


def _cell_edges(x: np.ndarray) -> np.ndarray:
  """Cell boundaries around sorted centres x (a lone centre gets width 1)."""
  gaps = np.diff(x) if len(x) > 1 else np.ones(1)
  return np.concatenate([[x[0] - gaps[0] / 2], x[:-1] + gaps / 2, [x[-1] + gaps[-1] / 2]])


def plot_expert_load(xs: list[int], counts: list[list[int]], layer: int, out: str) -> str:
  """Heatmap of each expert's share of the layer's routed tokens (counts per step at xs)."""
  from matplotlib.colors import TwoSlopeNorm
  plt = _pyplot()
  counts_stepsxE = np.asarray(counts, dtype=float)
  share_Exsteps = (counts_stepsxE / np.maximum(counts_stepsxE.sum(axis=1, keepdims=True), 1)).T
  experts = share_Exsteps.shape[0]
  uniform = 1 / experts
  norm = TwoSlopeNorm(vcenter=uniform, vmin=0, vmax=max(share_Exsteps.max(), 2 * uniform))
  fig, ax = plt.subplots(figsize=(10, 1.5 + 0.25 * min(experts, 40)), layout="constrained")
  mesh = ax.pcolormesh(_cell_edges(np.asarray(xs, dtype=float)), np.arange(experts + 1) - 0.5,
                       share_Exsteps, cmap="RdBu_r", norm=norm)
  fig.colorbar(mesh, ax=ax, label=f"share of tokens (white = 1/{experts})")
  if experts <= 32:
    ax.set_yticks(range(experts))
  _step_axis(ax)
  ax.set(ylabel="expert", title=f"MoE layer {layer}: expert share of tokens")
  return _save(fig, os.path.join(out, f"expert_load_layer{layer}.png"))


def _mark_switches(ax, switches: list[dict], label: bool) -> None:
  """One dotted line per switch step, labelled with its layers and policy ("L0,L1 smartmoe")."""
  by_step: dict[int, list[dict]] = {}
  for sw in switches:
    by_step.setdefault(sw["step"], []).append(sw)
  for step, sws in by_step.items():
    ax.axvline(step, color="0.4", linestyle=":", linewidth=1)
    if label:
      policies = "/".join(dict.fromkeys(str(sw.get("policy", "")) for sw in sws))
      text = "L" + ",".join(str(sw.get("layer")) for sw in sws) + f" {policies}"
      ax.annotate(text, (step, 1), xycoords=("data", "axes fraction"), rotation=90,
                  xytext=(2, -3), textcoords="offset points", va="top", fontsize=7, color="0.3",
                  bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 1})


def plot_device_load(steps: list[dict], switches: list[dict], out: str) -> str:
  """Max/mean device load and dropped fraction per layer, with layout switches marked."""
  plt = _pyplot()
  fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5), layout="constrained",
                                    height_ratios=[2, 1])
  for layer, (xs, ys) in _layer_series(steps, "max_over_mean_load").items():
    top.plot(xs, ys, label=f"layer {layer}", linewidth=1.2)
  for layer, (xs, ys) in _layer_series(steps, "dropped_fraction").items():
    bottom.plot(xs, ys, label=f"layer {layer}", linewidth=1.2)
  top.axhline(1.0, color="k", linewidth=0.8, alpha=0.5)
  _mark_switches(top, switches, label=True)
  _mark_switches(bottom, switches, label=False)
  title = "device load" + (" (dotted: layout switches)" if switches else "")
  top.set(ylabel="max / mean device load", title=title)
  _step_axis(bottom)
  bottom.set_ylabel("dropped fraction")
  bottom.set_ylim(bottom=0)
  fig.legend(*top.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
  return _save(fig, os.path.join(out, "device_load.png"))


def plot_loss(steps: list[dict], evals: list[dict], out: str) -> str:
  """Training loss and cross-entropy over steps, eval loss as points."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(10, 5), layout="constrained")
  xs = [r["step"] for r in steps]
  ax.plot(xs, [r["loss"] for r in steps], label="train loss", linewidth=1.2)
  ax.plot(xs, [r.get("ce", np.nan) for r in steps], label="train ce", linewidth=1, alpha=0.7)
  if evals:
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o", color="C3",
            label="eval loss")
  _step_axis(ax)
  ax.set(ylabel="loss", title="loss")
  ax.grid(alpha=0.3)
  ax.legend()
  return _save(fig, os.path.join(out, "loss.png"))


def plot_replay(path: str, out: str) -> str:
  """Max/mean device load per step (mean over layers) for each replayed policy."""
  plt = _pyplot()
  with open(path) as f:
    replay = json.load(f)
  fig, ax = plt.subplots(figsize=(10, 5), layout="constrained")
  for name, res in replay.get("policies", {}).items():
    series = np.asarray(res.get("series", []), dtype=float)
    if series.size:
      per_step = series.mean(axis=1) if series.ndim == 2 else series
      median = res.get("median", np.nan)
      line, = ax.plot(per_step, label=f"{name} (median {median:.3f})", linewidth=1)
      ax.axhline(median, color=line.get_color(), linestyle="--", linewidth=0.8)
  ax.axhline(1.0, color="k", linewidth=0.8, alpha=0.5)
  trace = os.path.basename(str(replay.get("trace", "")))
  _step_axis(ax, "replayed step")
  ax.set(ylabel="max / mean device load (mean over layers)",
         title=f"replay {trace}: {replay.get('devices')} devices, {replay.get('slots')} slots")
  ax.legend(fontsize=8, title="dashed: median", title_fontsize=8)
  stem = os.path.splitext(os.path.basename(path))[0]
  return _save(fig, os.path.join(out, f"replay_{stem}.png"))


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="python -m moejax.report",
                     description="Writes PNG plots of a run's metrics (expert and device load, "
                                 "loss) and of replay results, and prints their paths.")
  p.add_argument("run_dir", help="The run directory holding metrics.jsonl (its train.run_dir).")
  p.add_argument("--replay", action="extend", nargs="+", default=[],
                 help="JSON files written by python -m moejax.replay --json, to plot too.")
  p.add_argument("--out", help="The output directory (default: RUN_DIR/plots).")
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  _pyplot()   # fail early, with one line, when matplotlib is missing
  metrics_path = os.path.join(args.run_dir, "metrics.jsonl")
  if not os.path.exists(metrics_path):
    return fail(f"{args.run_dir} holds no metrics.jsonl; give the directory a train.py run "
                "wrote into (its train.run_dir).")
  metrics = load_metrics(metrics_path)
  steps = metrics["steps"]
  if not steps and not metrics["evals"]:
    return fail(f"{metrics_path} holds no step records (the run stopped before its first "
                "step, or the file was emptied); give the run dir of a run that trained.")
  for path in args.replay:   # all of them readable before any plot is written
    try:
      with open(path) as f:
        replay = json.load(f)
    except (OSError, ValueError) as e:
      return fail(f"--replay {path}: not a readable JSON file ({type(e).__name__}); give a file "
                  "written by python -m moejax.replay --json.")
    if not isinstance(replay, dict) or "policies" not in replay:
      return fail(f"--replay {path}: no 'policies' in it; give a file written by python -m "
                  "moejax.replay --json.")
  out = args.out or os.path.join(args.run_dir, "plots")
  os.makedirs(out, exist_ok=True)
  loads = _layer_series(steps, "expert_counts")
  paths = [plot_expert_load(xs, counts, layer, out) for layer, (xs, counts) in loads.items()]
  if loads:
    paths.append(plot_device_load(steps, metrics["switches"], out))
  if steps:
    paths.append(plot_loss(steps, metrics["evals"], out))
  paths += [plot_replay(path, out) for path in args.replay]
  for path in paths:
    print(path)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
