"""Result families of the trainer on CPU devices: the layer, capacity, the cost model,
routers, the strategy pool, faults, re-planning's price."""

from __future__ import annotations

import statistics

from benchmarks.families import Section, family, num, pct, ratio, table


@family("balance_pays", "Balance that pays: tokens/s at the capacity that drops <= 1%")
def _balance_pays(files):
  lines, head = [], []
  labels = {"static": "static, per slot", "static_pooled": "static, pooled",
            "smartmoe": "smartmoe, pooled", "fsep": "fsep, pooled"}
  for name, d in files.items():
    rows = []
    for policy, label in labels.items():
      cfs = " / ".join(f"{r['capacity_factor']:.2f}" for r in d["rows"] if r["policy"] == policy)
      layer = d["ratios"].get(f"{policy}/tokens_per_s")
      step = d["ratios"].get(f"{policy}/step_tokens_per_s")
      fmt = lambda q: (f"{q['geomean']:.2f}x ({', '.join(f'{x:.2f}' for x in q['per_seed'])})"
                       if q else "1.00x")
      rows.append([label, cfs, fmt(layer), fmt(step)])
    a = d["args"]
    lines += [f"`{name}`: E = {a['experts']}, top-{a['top_k']}, d_model {a['d_model']}, d_ff "
              f"{a['d_ff']}, {a['tokens_per_device']} tokens per device, seeds "
              f"{', '.join(map(str, a['seeds']))}, {a['rounds']} rounds; tokens/s over static "
              "per-slot, geometric mean over seeds (per seed).", "",
              *table(["policy", "capacity factor per seed", "MoE layer", "whole step"], rows),
              ""]
    if name == "balance_pays_cpu.json":
      r = d["ratios"]
      head.append(("MoE layer tokens/s over static per-slot, each at <= 1% dropped: pooled "
                   "static, SmartMoE, fsep",
                   f"{r['static_pooled/tokens_per_s']['geomean']:.2f}x, "
                   f"{r['smartmoe/tokens_per_s']['geomean']:.2f}x, "
                   f"{r['fsep/tokens_per_s']['geomean']:.2f}x", name))
  return Section(lines[:-1], head)


@family("fsep_vs_ep", "fsep vs ep, one MoE layer at the capacity that drops nothing")
def _fsep_vs_ep(files):
  rows, head = [], []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([r["mode"], f"{r['capacity_factor']:.2f}", r["dropped"],
                   num(r["tokens_per_s"], 0), f"`{name}`"])
    head.append(("MoE layer tokens/s, fsep over static ep on skewed routing, both dropping "
                 "nothing", ratio(d["ratio"]), name))
  ratios = ", ".join(f"{ratio(d['ratio'])} (`{n}`)" for n, d in files.items())
  return Section([f"fsep's tokens/s over ep's: {ratios}.", "",
                  *table(["mode", "capacity factor", "dropped", "tokens/s", "file"], rows)],
                 head)


@family("moe_layer", "The MoE layer against the single-device reference")
def _moe_layer(files):
  rows = []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([r["config"], r["mesh"], r["kind"], num(r["ms_per_iter"], 0),
                   num(r["tokens_per_s"], 0), pct(r["dropped_fraction"]),
                   f"{r['max_abs_diff_y_vs_ref']:.1e}", f"`{name}`"])
  return Section(table(["shape", "mesh", "kind", "ms fwd+bwd", "tokens/s", "dropped",
                        "max diff vs reference", "file"], rows))


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


@family("published_mixtral", "Mixtral-8x7B on 64 H100: the cost model vs Megatron-Core")
def _published(files):
  rows, head = [], []
  for name, d in files.items():
    p = d["published"]
    for r in d["rows"]:
      rows.append([r["layout"], r["profile"], "on" if r["remat"] else "off",
                   f"{r['predicted_step_s']:.3f}", num(r["predicted_tflops_per_gpu"], 0),
                   f"{r['error']:+.0%}", f"{r['memory_gib']:.1f}", f"`{name}`"])
    megatron = {r["profile"]: r for r in d["rows"] if not r["remat"]
                and r["layout"] == "PP4 VP8 EP8 DP2 (Megatron's)"}
    own, dot = megatron.get("h100_ep_node"), megatron.get("h100_ep_node, grouped at dot rate")
    if own and dot:
      head.append((f"Mixtral-8x7B on 64 H100, predicted step vs Megatron-Core's published "
                   f"{p['tflops_per_gpu']:.0f} TFLOP/s: moejax's grouped kernel, expert "
                   "matmuls at the dense-dot rate", f"{own['error']:+.0%}, {dot['error']:+.0%}",
                   name))
  p = next(iter(files.values()))["published"]
  return Section([f"Published: {p['tflops_per_gpu']:.0f} TFLOP/s per GPU, {p['step_s']:.3f} s "
                  f"per step ({p['layout']}, {p['gpus']} GPUs; {p['source']}). Predicted, not "
                  "run: no Mixtral step has run on a GPU here.", "",
                  *table(["layout", "profile", "remat", "predicted s / step", "TFLOP/s per GPU",
                          "error", "GiB / GPU", "file"], rows)], head)


@family("chaos", "Kill soak: killed and resumed, compared bit for bit")
def _chaos(files):
  rows, head = [], []
  for name, d in files.items():
    s = d["summary"]
    rows.append([s["kills_survived"], s["sigterm_stops"], s["kills_during_a_save"],
                 s["kills_inside_a_migration"], s["steps_recomputed"], num(s["seconds_lost"], 1),
                 "yes" if s["final_digest_identical"] else "no",
                 "yes" if s["metrics_identical"] else "no", f"`{name}`"])
    same = s["final_digest_identical"] and s["metrics_identical"]
    head.append((f"kill soak: {s['kills_survived']} SIGKILLs (in saves and migrations too), "
                 "each resumed: final state and metrics vs an uninterrupted run",
                 "bit for bit the same" if same else "different", name))
  return Section(table(["kills", "SIGTERM stops", "kills in a save", "kills in a migration",
                        "steps recomputed", "seconds lost", "same final state",
                        "same metrics", "file"], rows), head)


@family("ragged_memory", "The ragged receive buffer")
def _ragged_memory(files):
  rows, arith = [], []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([r["devices"], r["factor"], num(r["rows"]), num(r["cuda_buffer_bytes"]),
                   num(r["cpu_temp_bytes"]), f"`{name}`"])
    for r in d["arithmetic"]:
      arith.append([r["devices"], r["factor"], r["top_k"], num(r["tokens"]), r["d_model"],
                    f"{r['buffer_gib']:.1f}"])
  return Section(["Read from the CUDA-lowered program at small shapes (and XLA:CPU's compiled "
                  "temp bytes with the emulated collective):", "",
                  *table(["N", "factor", "receive rows", "CUDA buffer bytes", "CPU temp bytes",
                          "file"], rows), "", "Arithmetic at a large shape (bf16 rows):", "",
                  *table(["N", "factor", "top_k", "tokens", "d_model", "GiB per layer"],
                         arith)])


@family("convert_memory", "Hugging Face conversion: peak host memory against the arithmetic")
def _convert_memory(files):
  rows = [[num(d["params"]), num(d["float32_params_mib"], 1), num(d["largest_param_mib"], 1),
           num(d["from_hf_peak_mib"], 0), num(d["to_hf_peak_mib"], 0),
           num(d["arithmetic_digest_peak_mib"], 0), f"`{name}`"] for name, d in files.items()]
  return Section(table(["parameters", "fp32 params MiB", "largest param MiB",
                        "from_hf peak MiB", "to_hf peak MiB", "arithmetic peak MiB", "file"],
                       rows))


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
