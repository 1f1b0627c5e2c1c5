"""How the results of the strategy cost model and the online switch read as tables: the families of
results/, registered with `benchmarks.families.family`; `python -m benchmarks.render` assembles
them."""

from __future__ import annotations

from benchmarks.families import Section, family, num, pct, table


@family("cost_model", "The strategy cost model, predicted vs measured step time")
def _cost_model(files):
  rows, bubble, head = [], [], []
  for name, d in files.items():
    pool = [m for m in d["members"] if m["role"] == "pool"]
    rows.append([f"`{name}`", len(d["members"]) - len(pool), len(pool), pct(d["mape"], 1),
                 pct(d["mape_micro_only"], 1), pct(d["mape_cpu_preset"], 1)])
    for b in d.get("bubble", []):
      if b["stages"] > 1 and b["vs_microbatches"] > 1:
        bubble.append([b["strategy"], b["stages"], b["microbatches"], pct(b["bubble"], 1),
                       f"{b['measured_ratio']:.3f}", f"{b['predicted_ratio']:.3f}"])
  flat, piped = files.get("cost_model_cpu.json"), files.get("cost_model_cpu_pipeline.json")
  if flat and piped:
    head.append(("cost model's error on measured step times (MAPE): flat pool, pipelined "
                 "pool", f"{pct(flat['mape'], 1)}, {pct(piped['mape'], 1)}",
                 "cost_model_cpu.json"))
  lines = table(["file", "fit members", "pool members", "pool MAPE", "micro-benchmarks only",
                 "`cpu` preset"], rows)
  if bubble:
    lines += ["", "The pipeline bubble: step time over the same stages' M = 1 member.", "",
              *table(["strategy", "P", "M", "bubble", "measured / M=1", "predicted / M=1"],
                     bubble)]
  return Section(lines, head)


@family("strategy_switch", "Strategy switching under a drifting load")
def _strategy_switch(files):
  rows = []
  for name, d in files.items():
    for r in d["runs"]:
      phases = " / ".join(f"{x:.1%}" for x in r.get("dropped_by_phase") or [])
      rows.append([f"`{name}`", r["label"], num(r["seconds"], 2), pct(r["dropped"]), phases,
                   len(r.get("switches") or []), r.get("compiles_in_window", "")])
  return Section(["Each run restores the same warm-up, then the load goes uniform -> one hot "
                  "expert -> uniform; the runs train side by side, one step each in turn. "
                  "Seconds: the best of the repeats.", "",
                  *table(["file", "run", "seconds", "dropped", "dropped per phase",
                          "strategy switches", "compiles"], rows)])
