"""How the results of the planners against an earlier commit read as tables: the families of
results/, registered with `benchmarks.families.family`; `python -m benchmarks.render` assembles
them."""

from __future__ import annotations

import json

from benchmarks.families import Section, family, num, pct, ratio, table


@family("planner_ab", "The fsep planner against a base commit, interleaved")
def _planner_ab(files):
  rows = []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([d["base"], r["experts"], r["devices"], "yes" if r["same_plan"] else "no",
                   f"{r['wall_base_ms']:.2f} -> {r['wall_new_ms']:.2f}", ratio(r["wall_ratio"]),
                   ratio(r["cpu_ratio"]), f"`{name}`"])
  return Section(table(["base", "E", "N", "same plan", "wall ms base -> this", "wall ratio",
                        "CPU ratio", "file"], rows))


@family("planner_replay_ab", "Every replay planner call against a base commit")
def _planner_replay_ab(files):
  rows = []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([d["base"], r["trace"], r["devices"], json.dumps(r["options"]) if r["options"]
                   else "defaults", r["calls"], r["different_plans"], f"`{name}`"])
  return Section(table(["base", "trace", "N", "options", "calls", "different plans", "file"],
                       rows))


@family("smartmoe", "SmartMoE under pooled capacity: plans, drops and time against a base commit")
def _smartmoe(files):
  lines = []
  for name, d in files.items():      # benchmarks.ab.smartmoe_ab
    rows = [[r["trace"], r["experts"], r["devices"],
             *(f"{pct(r['base'][k])} -> {pct(r['this'][k])}"
               for k in ("planned_dropped", "realised_dropped")),
             f"{num(r['base']['max_over_mean'])} -> {num(r['this']['max_over_mean'])}",
             r["this"]["decisions"], f"`{name}`"] for r in d["traces"]]
    lines += [f"Base {d['base']} -> this tree, cf {d['capacity_factor']}, a decision every 10 "
              "steps from the last 10: drops on the window planned on and on the steps "
              "served.", "", *table(["trace", "E", "N", "planned dropped", "realised dropped",
                                     "max/mean", "decisions", "file"], rows), ""]
    job = d["default_job"]
    lines += ["The default job's decisions, as the trainer's re-planner makes them, replayed "
              f"on a logged run, steps 150-299 dropped: base {pct(job['base'])}, this "
              f"{pct(job['this'])}.", ""]
    rows = [[t["experts"], t["devices"], num(t["ms_per_layer"]["base"], 1),
             num(t["ms_per_layer"]["this"], 1), ratio(t["speedup"]), t["calls"], f"`{name}`"]
            for t in d["time"]]
    lines += ["The trainer's call, both planners interleaved (ms per layer decision, median):",
              "", *table(["E", "N", "base ms", "this ms", "speedup", "calls", "file"], rows), ""]
  return Section(lines)
