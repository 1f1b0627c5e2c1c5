"""Result families of the placement policies and their planners (host arithmetic)."""

from __future__ import annotations

import json
import os

from benchmarks.families import Section, family, num, pct, ratio, table


@family("replay_", "Placement policies on routing traces")
def _replay(files):
  rows, head = [], []
  for name, d in files.items():
    pol = d["policies"]
    cell = lambda p: f"{p['median']:.3f} / {p['p90']:.3f}" if p else ""
    shares = f", shares {d['shares']}" if d.get("shares") else ""
    rows.append([f"{os.path.basename(d['trace'])}{shares}", d["devices"], d["experts"],
                 *(cell(pol.get(k)) for k in ("static", "smartmoe", "shadow", "fsep")),
                 cell(d.get("oracle")), cell(d.get("window_oracle")), f"`{name}`"])
  drift = files.get("replay_drift_bursts_N8.json")
  adaptive = files.get("replay_drift_bursts_N8_adaptive.json")
  if drift and adaptive:
    p = drift["policies"]
    head.append(("busiest device over the mean, drift-bursts trace, N = 8, median / p90: "
                 "static, SmartMoE, fsep, fsep with adaptive shares",
                 f"{p['static']['median']:.3f} / {p['static']['p90']:.3f}, "
                 f"{p['smartmoe']['median']:.3f} / {p['smartmoe']['p90']:.3f}, "
                 f"{p['fsep']['median']:.3f} / {p['fsep']['p90']:.3f}, "
                 f"{adaptive['policies']['fsep']['median']:.3f} / "
                 f"{adaptive['policies']['fsep']['p90']:.3f}",
                 "replay_drift_bursts_N8.json"))
  return Section(["The busiest device's routed load over the mean (choices before capacity), "
                  "median / p90 over steps x layers, each layout planned from earlier steps "
                  "only; `oracle` plans each step on its own counts, `window oracle` each "
                  "decision on the steps it will serve.", "",
                  *table(["trace", "N", "E", "static", "smartmoe", "shadow", "fsep", "oracle",
                          "window oracle", "file"], rows)], head)


@family("adaptive_capacity", "fsep with planned vs adaptive token shares")
def _adaptive(files):
  rows = []
  for name, d in files.items():
    for rule in ("planned", "adaptive"):
      r = d[rule]
      drops = d["dropped_at"]
      rows.append([os.path.basename(d["trace"]), rule,
                   f"{r['max_over_mean']['median']:.3f} / {r['max_over_mean']['p90']:.3f}",
                   f"{r['slot']['median']:.2f}", f"{r['device']['median']:.2f}",
                   *(f"{pct(drops[f][rule]['slot'])} / {pct(drops[f][rule]['device'])}"
                     for f in sorted(drops, key=float)), f"`{name}`"])
  factors = sorted(next(iter(files.values()))["dropped_at"], key=float)
  return Section(["Host arithmetic on the traces: max/mean (median / p90), the smallest "
                  "capacity factor that drops at most 1% (median over steps) per capacity "
                  "mode, and the drops (slot / device) at fixed factors.", "",
                  *table(["trace", "shares", "max/mean", "cf slot", "cf device",
                          *(f"dropped at cf {f}" for f in factors), "file"], rows)])


@family("planner_time", "Planner time per decision")
def _planner_time(files):
  rows, head = [], []
  for name, d in files.items():
    # planner_time.json's fsep rows predate the planner's current arithmetic; its other
    # policies' rows are the only record. planner_time_fsep.json holds the fsep rows.
    picked = [r for r in d["rows"] if r["policy"] != "fsep"]
    if name == "planner_time_fsep.json":
      picked = d["fsep_rows"]
    for r in picked:
      if r["status"] != "ok":
        continue
      options = ", ".join(f"{k}={v}" for k, v in (r.get("options") or {}).items())
      rows.append([r["policy"], options or "defaults", r["experts"], r["devices"], r["slots"],
                   num(r["ms_median"]), f"{num(r['ms_min'])} - {num(r['ms_max'])}",
                   num(r["max_over_mean"]), f"`{name}`"])
  trainer = []
  for name, d in files.items():
    for r in d.get("trainer_rows", []):
      trainer.append([r["policy"], r["experts"], r["devices"], r["slots"], r["layers"],
                      r["window"], num(r["ms_per_layer_median"], 2),
                      num(r["ms_per_replan_median"], 1), r["calls"], f"`{name}`"])
    picks = {(r["policy"], r["experts"], r["devices"]): r for r in d.get("trainer_rows", [])}
    fsep, smartmoe = picks.get(("fsep", 256, 4096)), picks.get(("smartmoe", 256, 64))
    if fsep and smartmoe:
      head.append(("The trainer's re-plan (its options, window and layers), median time per "
                   "layer decision: fsep E = 256 on N = 4096; SmartMoE pooled E = 256 on N = 64",
                   f"{fsep['ms_per_layer_median']:.1f} ms; "
                   f"{smartmoe['ms_per_layer_median']:.0f} ms", name))
  return Section(["Wall time per planner call (numpy on the host), median and range over the "
                  "calls, and the plan's max/mean on its own load.", "",
                  *table(["policy", "options", "E", "N", "C", "median ms", "min - max ms",
                          "max/mean", "file"], rows), "",
                  "The call the trainer makes (`OnlinePlanner.propose` of the trainer's "
                  "re-planner, after a window of observed steps): every MoE layer of one "
                  "re-plan, per layer and per re-plan.", "",
                  *table(["policy", "E", "N", "C", "layers", "window", "ms per layer",
                          "ms per re-plan", "calls", "file"], trainer)], head)


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


@family("replan_sweep", "Fixed dyn.X against adaptive dyn.X on a trace")
def _replan_sweep(files):
  rows, head = [], []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([r["profile"], r["policy"], r["rule"], r["every"],
                   f"{r['median']:.3f} / {r['p90']:.3f} / {r['p99']:.3f}", r["switches"],
                   r["experts_moved"], f"{r['migrated_bytes'] / 2**20:.1f}",
                   f"{r['migration_s']:.4g}", f"{r['paid_s']:.5g}", f"`{name}`"])
    for profile in dict.fromkeys(r["profile"] for r in d["rows"]):
      ep = [r for r in d["rows"] if r["profile"] == profile and r["policy"] == "smartmoe"]
      if not ep:
        continue
      best = min(ep, key=lambda r: r["paid_s"])
      head.append((f"dyn.X on {os.path.basename(d['trace'])}, SmartMoE, `{profile}` prices: "
                   "the rule the run pays least under (expert compute + migration)",
                   f"{best['rule']} X = {best['every']}, {best['paid_s']:.5g} s, "
                   f"{best['migrated_bytes'] / 2**20:.1f} MiB moved", name))
  return Section(["Replay of the trace with the default run's expert size, each rule planning "
                  "once after the first step, then every X steps (fixed) or after every step "
                  "where the priced gain over X steps beats the migration (adaptive). max/mean "
                  "is median / p90 / p99 over steps x layers; bytes are weights and both Adam "
                  "moments of every copy moved (fsep moves none); paid = the busiest device's "
                  "expert compute over the trace plus the migrations, by the profile's cost "
                  "model.", "",
                  *table(["profile", "policy", "rule", "X", "max/mean", "switches",
                          "experts moved", "MiB moved", "migration s", "paid s", "file"],
                         rows)], head)


@family("migration_bytes", "What an ep migration sends, in the compiled program")
def _migration_bytes(files):
  rows = []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([r["mesh"], r["experts"], r["layers"], r["budget"], r["moved_experts_max"],
                   f"{r['moved_only']['bytes'] / 2**20:.2f} "
                   f"({', '.join(sorted(r['moved_only']['collectives']))})",
                   f"{r['whole']['bytes'] / 2**20:.2f} "
                   f"({', '.join(sorted(r['whole']['collectives']))})",
                   ratio(r["whole"]["bytes"] / r["moved_only"]["bytes"]), f"`{name}`"])
  return Section(["Collective bytes per device of one migration of the expert weights and both "
                  "Adam moments, read from the programs the trainer's switch compiles for the "
                  "default run's training state (`migrate.migration_call`): the moved-only "
                  "program (B rows per device pair, any layout that fits) against the whole "
                  "permutation.", "",
                  *table(["mesh (data x expert x model)", "E", "L", "B", "experts it can move",
                          "moved-only MiB", "whole MiB", "whole / moved-only", "file"], rows)])


@family("smartmoe", "SmartMoE under pooled capacity: plans, drops and time against a base commit")
def _smartmoe(files):
  lines = []
  for name, d in files.items():      # benchmarks.smartmoe_ab
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
