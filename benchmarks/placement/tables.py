"""How the results of the placement policies and their planners read as tables: the families of
results/, registered with `benchmarks.families.family`; `python -m benchmarks.render` assembles
them."""

from __future__ import annotations

import os
import statistics

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


@family("routers", "Routers x placement on the default job")
def _routers(files):
  rows, head = [], []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([r["arm"], f"{r['eval_loss']:.4f}", f"{r['realised_max_over_mean']:.3f}",
                   pct(r["dropped_fraction"]), num(r["tokens_per_s"], 0), r["layout_switches"],
                   f"`{name}`"])
    by = {r["arm"]: r for r in d["rows"]}
    if "softmax/static" in by and "softmax/smartmoe" in by:
      head.append((f"default job, {d['steps']} steps: dropped choices, static layout vs "
                   f"SmartMoE re-placing every {d['every']} steps (softmax router)",
                   f"{pct(by['softmax/static']['dropped_fraction'])} vs "
                   f"{pct(by['softmax/smartmoe']['dropped_fraction'])}", name))
  return Section(["Eval loss after the last step; the rest over the second half of the run; "
                  "the arms are interleaved step by step, so tokens/s is a work measure.", "",
                  *table(["router / placement", "eval loss", "realised max/mean", "dropped",
                          "tokens/s", "layout switches", "file"], rows)], head)


@family("replan_overhead", "Re-planning every step: the default job's step time")
def _replan_overhead(files):
  lines, head = [], []
  for name, d in files.items():
    rows, a = [], d["args"]
    base = a.get("base", "every1000")
    for v, knobs in d["variants"].items():
      runs = [r for r in d["rows"] if r["variant"] == v]
      q = d["ratios"].get(v)

      def med(key, runs=runs):
        return statistics.median(r[key] for r in runs)

      def fmt(k, q=q):
        if not q:
          return "1"
        return f"{q[k]['median']:.3f}x ({', '.join(f'{x:.3f}' for x in q[k]['per_repeat'])})"
      where = ", planned on the loop's thread" if v.endswith("_nothread") else ""
      rows.append([v, ", ".join(f"`{k} = {x}`" for k, x in knobs.items()) + where,
                   num(med("median_step_s")), num(med("mean_step_s")), fmt("mean_step"),
                   fmt("median_step"), num(med("plans"), 0), num(med("planning_ms_per_plan"), 2),
                   num(med("waited_s")), num(med("migrations"), 0),
                   num(med("migration_ms_each"), 0), pct(med("timed_migration_share"), 1),
                   pct(med("timed_loop_planning_share"), 1), pct(med("dropped_fraction")),
                   pct(med("static_dropped_fraction"))])
    loads = [r["load_before"]["1min"] for r in d["rows"]]
    lines += [f"`{name}`: the default job, {a['steps']} steps a run, the first {a['warmup']} "
              f"not timed, {a['repeats']} repeats interleaved; host load (1 min) "
              f"{min(loads)}-{max(loads)}. Medians over repeats; ratios over {base} within "
              "each repeat (per repeat in brackets). Migrating, planning on the loop: the timed "
              "steps' share spent migrating, and planning on the loop's thread or waiting for "
              "the planning thread. Dropped: the run's second half, against the static "
              "layout's on the same batches.", "",
              *table(["variant", "knobs", "median step s", "mean step s", f"mean over {base}",
                      f"median over {base}", "re-plans", "planning ms each", "waited s",
                      "migrations", "migration ms each", "migrating", "planning on the loop",
                      "dropped", "static dropped"], rows),
              ""]
    if base == "every1000" and "every1_lag1" in d["ratios"]:
      r = d["ratios"]["every1_lag1"]
      head.append(("Default job, step time with `planner.every = 1` (planned on a thread, "
                   "`planner.lag = 1`) over `every = 1000`: mean; median",
                   f"{r['mean_step']['median']:.2f}x; {r['median_step']['median']:.2f}x", name))
  return Section(lines[:-1], head)
