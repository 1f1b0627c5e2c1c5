"""How the results of one MoE layer (against its reference, its time and memory, balance that pays)
read as tables: the families of results/, registered with `benchmarks.families.family`; `python
-m benchmarks.render` assembles them."""

from __future__ import annotations

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
