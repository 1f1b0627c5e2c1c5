"""How the cluster study's results read as tables: what balancing the experts buys compile-only
H100 clusters (`study`), the same fraction measured on the 8 fake CPU devices (`cpu`), and the
programs' per-layer scaling (`layers`); the families of results/, registered with
`benchmarks.families.family`; `python -m benchmarks.render` assembles them."""

from __future__ import annotations

from benchmarks.families import Section, family, num, table

# The goals at 64 GPUs on these routings (docs/guide/cluster-study.md).
GOAL_ROUTINGS = ("drift_bursts", "default_run")
MODEL_NAMES = {"mixtral_8x7b": "Mixtral-8x7B", "qwen3_30b_a3b": "Qwen3-30B-A3B"}


def _f(x, digits: int = 2) -> str:
  return "" if x is None else f"{x:.{digits}f}"


def _skew(d: dict, r: dict) -> str:
  rp = d["replays"].get(f"{r['model']}/{r['expert_axis']}/{r['routing']}", {})
  return _f(rp.get("skew", {}).get("expert_max_over_mean_median"))


def _depth(d: dict, r: dict) -> str:
  """The row's layers: the model's, or extrapolated to them from two compiled depths."""
  cut = r.get("extrapolated_from")
  if cut:
    return f"{r['layers']} from {cut[0]}, {cut[1]}"
  return str(r.get("layers") or d["programs"][r["programs"][0]]["spec"]["layers"] or "full")


def _program(r: dict) -> str:
  """A program's expert kernels, and 'recomputed' where it runs the MoE exchange again in the
  backward although the model's config keeps it (the kept buffers did not fit)."""
  return r.get("kernels", "grouped") + (" recomputed" if r.get("exchange_recomputed") else "")


def _kernels(r: dict) -> str:
  """The row's program (`_program`), and the other programs' steps where they were compiled
  too."""
  others = [f"{_program(a)} {a['step_s']:.3f}{'' if a['fits'] else ' no fit'}"
            for a in r.get("alternatives", ()) if a.get("step_s") is not None]
  return _program(r) + (f" ({', '.join(others)})" if others else "")


def _row(d: dict, r: dict) -> list:
  if "error" in r:
    return [MODEL_NAMES[r["model"]], r["gpus"], _depth(d, r), r["routing"], "", r["policy"],
            _kernels(r), f"{r['needed_factor']:.3f}", f"not compiled: {r['error'][:80]}",
            *[""] * 6]
  paid = r["paid_replan_exposed_s"] + r["paid_migration_s"]
  return [MODEL_NAMES[r["model"]], r["gpus"], _depth(d, r), r["routing"], _skew(d, r),
          r["policy"], _kernels(r),
          f"{r['needed_factor']:.3f} -> {r['factor']:.3f}", _f(r["busiest_over_mean"]),
          _f(r["step_s"], 3), num(r["tokens_per_s"], 0), _f(r["fraction_of_balanced"], 3),
          f"{r['speedup_over_static']:.2f}x" if r.get("speedup_over_static") else "",
          f"{r['paid_replan_s']:.3f} / {paid * 1e3:.1f}",
          f"{r['peak_gib']:.0f}{'' if r['fits'] else ' (no)'}"]


def _best(rows: list[dict]) -> dict:
  return max(rows, key=lambda r: r["tokens_per_s"])


def _published(d: dict, ok: list[dict]) -> str | None:
  """Mixtral's uniform step against Megatron-Core's published one, where the file has it."""
  uniform = [r for r in ok if r["model"] == "mixtral_8x7b" and r["gpus"] == 64 and
             r["routing"] == "uniform" and r["policy"] == "static"]
  published = d.get("published", {}).get("step_s")
  if not (uniform and published):
    return None
  r = uniform[0]
  prog = d["programs"][r["programs"][0]]
  # The program's own numbers (extrapolated where the row is), else its compiled row's.
  compute = r.get("program_compute_s", prog["compute_s"])
  gmm = r.get("program_grouped_matmul_s", prog["grouped_matmul"]["seconds"])
  exposed = r.get("program_exposed_comm_s", prog["exposed_comm_s"])
  den = d["denominators"].get("mixtral_8x7b/64", {})
  kernels = r.get("kernels", "grouped")
  other = "grouped" if kernels == "einsum" else "einsum"
  # the denominator is static EP's uniform row, the same pick; of the other kernel's programs
  # (its exchange kept or recomputed) the fastest that fits
  others = [p for p in (den.get(other), den.get(other + "_recomputed")) if p]
  alt = min([p for p in others if p["fits"]] or others, key=lambda p: p["step_s"],
            default=None)
  names = {"grouped": "pooled grouped-matmul program", "einsum": "per-slot einsum program"}
  again = ", exchange recomputed" if r.get("exchange_recomputed") else ""
  return (f"uniform routing, static EP at factor 1.0 (fused attention costed), its "
          f"{names[kernels]}{again}: {r['step_s']:.2f} s a step, "
          f"{r['step_s'] / published:.2f}x "
          f"Megatron-Core's published {published:.2f} s; compute {compute:.2f} s"
          + (f" ({gmm:.2f} s the grouped expert matmul)" if gmm else "")
          + f", communication exposed {exposed:.2f} s"
          + (f"; its {names[other]} {alt['step_s']:.2f} s, {alt['step_s'] / published:.2f}x"
             + ("" if alt["fits"] else " (does not fit)") if alt else ""))


def _goals(name: str, d: dict) -> list[tuple[str, str, str]]:
  """README rows, one per model at the goals' GPU counts (64, 256) in the file: fsep's and
  SmartMoE's fraction of force-balanced and the best policy over static EP on the goal
  routings; at 64, Mixtral's uniform step against Megatron-Core's published one."""
  head = []
  ok = [r for r in d["rows"] if "step_s" in r]
  published = _published(d, ok)
  for model, label in MODEL_NAMES.items():
    for gpus in (64, 256):
      cells, over, cut = [], [], None
      for routing in GOAL_ROUTINGS:
        got = {r["policy"]: r for r in ok if r["model"] == model and r["gpus"] == gpus and
               r["routing"] == routing}
        if not got:
          continue
        best = _best(list(got.values()))
        fsep = max((got[p] for p in ("fsep_planned", "fsep_adaptive") if p in got),
                   key=lambda r: r["tokens_per_s"], default=None)
        smart = got.get("smartmoe")
        cells.append(f"{routing}: fsep {_f(fsep and fsep['fraction_of_balanced'])}, SmartMoE "
                     f"{_f(smart and smart['fraction_of_balanced'])}, best "
                     f"({best['policy']}) {best['speedup_over_static']:.2f}x static EP")
        cut = best.get("extrapolated_from")
        over += [r for r in got.values() if not r["fits"]]
      if not cells:
        continue
      if over:
        peaks = [r["peak_gib"] for r in over]
        pool = (f"the {d['memory_fraction']} of the GPU's memory train.py gives JAX"
                if "memory_fraction" in d else "the GPU's memory")
        cells.append(f"over {pool}, estimated as if they fit: "
                     f"{', '.join(dict.fromkeys(r['policy'] for r in over))} "
                     f"({min(peaks):.0f}-{max(peaks):.0f} GiB)")
      what = (f"{label} on {gpus} compile-only H100s (schedule estimate, "
              + (f"programs at {cut[0]} and {cut[1]} layers extrapolated to the model's depth, "
                 if cut else "")
              + "trainer's planners replayed): fraction of force-balanced throughput at <= 1% "
              "drops; best policy over static EP")
      if published and (model, gpus) == ("mixtral_8x7b", 64):
        what += "; the force-balanced step against Megatron-Core's published one"
        cells.append(published)
      head.append((what, "; ".join(cells), name))
  return head


@family("cluster_h100", "Balance on a GPU cluster: policies under real routing, compile-only "
        "H100s")
def _cluster(files):
  lines, head = [], []
  for name, d in files.items():
    rows = [_row(d, r) for r in d["rows"]]
    programs = [[MODEL_NAMES[p["spec"]["model"]], p["spec"]["topology"],
                 p["spec"]["layers"] or "full", p["spec"]["kind"],
                 _f(p["spec"]["factor"], 3), p.get("strategy", ""),
                 _f(p.get("lower_s"), 0), _f(p.get("compile_s"), 0),
                 _f(p.get("step_s"), 3), _f(p.get("exposed_comm_s"), 3),
                 _f((p.get("grouped_matmul") or {}).get("seconds"), 3)]
                for p in d["programs"].values() if p.get("compiled")]
    lines += [f"`{name}`: per model, GPU count, routing and policy, the capacity factor the "
              "trainer's own planner needs for <= 1% drops on the routing (replayed; rounded "
              f"up to a multiple of {d['grid']} and compiled there), the busiest device's "
              "rows over the mean, the schedule estimate of that program with its grouped "
              "matmul scaled to the busiest device's rows (a dense policy is compiled on both "
              "expert kernels, each at the factor its buffers need, and takes the faster that "
              "fits in the share of the GPU's memory JAX's allocator gets (the whole GPU in "
              "files that name no `memory_fraction`); the others' steps in brackets; "
              "'recomputed': where the model keeps its MoE exchanges for the backward, "
              "each program again running them in the backward instead), plus the "
              "re-plan time beyond the step in flight and ep migrations; tokens/s; the fraction "
              "of the force-balanced throughput (static EP's fastest program at factor 1.0 on "
              "uniform routing) and the "
              "speedup over static EP on the routing. `layers` says where a row's programs were "
              "compiled at two cut depths and extrapolated to the model's (fixed part + "
              "layers x per-layer part). Every step is an estimate "
              "(docs/guide/cluster-study.md).", "",
              *table(["model", "GPUs", "layers", "routing", "expert max/mean", "policy",
                      "kernels (other s)", "factor needed -> compiled", "busiest/mean", "step s",
                      "tokens/s",
                      "of balanced", "vs static", "re-plan s / paid ms", "peak GiB (fits)"],
                     rows), "",
              "The programs (compiled once each, read by every routing at that buffer):", "",
              *table(["model", "topology", "layers", "kind", "factor", "strategy", "lower s",
                      "compile s", "step s", "exposed comm s", "grouped matmul s"], programs),
              ""]
    head += _goals(name, d)
  return Section(lines[:-1], head)


@family("cluster_cpu", "Balance on the 8 fake CPU devices: fraction of force-balanced, measured")
def _cluster_cpu(files):
  lines, head = [], []
  for name, d in files.items():
    rows = [[r["policy"], r["seed"], f"{r['capacity_factor']:.3f}",
             f"{100 * r['dropped_fraction']:.2f}%", num(r["tokens_per_s"], 0),
             num(r["uniform_tokens_per_s"], 0), f"{r['fraction_of_balanced']:.3f}",
             f"{r['fraction_of_own_uniform']:.3f}"] for r in d["rows"]]
    lines += [f"`{name}`: balance_pays' MoE layer (forward + backward) per policy at its "
              "factor for <= 1% drops under its skewed routing, and on a forced uniform "
              "routing at factor 1.0, timed interleaved; the fraction over static EP's uniform "
              "layer (force-balanced) and over the policy's own.", "",
              *table(["policy", "seed", "factor", "dropped", "tokens/s skewed",
                      "tokens/s uniform", "of force-balanced", "of own uniform"], rows), ""]
    g = d["geomean"]
    a = d["args"]
    head.append(("MoE layer on 8 fake CPU devices, skewed routing at <= 1% drops: fraction of "
                 "force-balanced (static EP, uniform routing, factor 1.0) throughput, geomean "
                 f"over seeds {', '.join(map(str, a['seeds']))} ({a['rounds']} rounds)",
                 ", ".join(f"{p} {v['fraction_of_balanced']:.2f}" for p, v in g.items()), name))
  return Section(lines[:-1], head)


@family("cluster_layers", "The cluster study's programs scaled per layer")
def _cluster_layers(files):
  lines = []
  for name, d in files.items():
    rows = []
    for r in d["rows"]:
      ext = r.get("extrapolated") or {}
      cut = "; ".join(f"{k} layers {v['step_s']:.3f} s ({'fits' if v['fits'] else 'does not fit'})"
                      for k, v in r["cut"].items() if v.get("step_s") is not None)
      rows.append([MODEL_NAMES[r["model"]], r["topology"], r["kind"], cut,
                   _f(ext.get("step_s"), 3), _f(ext.get("per_layer_s"), 4),
                   f"{r['full']['step_s']:.3f} ({'fits' if r['full']['fits'] else 'does not fit'})",
                   _f(r.get("extrapolated_over_full"), 3)])
    lines += [f"`{name}`: each program compiled at {' and '.join(map(str, d['depths']))} layers, "
              "its schedule estimate extrapolated linearly to the model's depth, beside the "
              "program compiled at full depth (where that does not fit the GPU, XLA's "
              "scheduler stops overlapping its collectives).", "",
              *table(["model", "topology", "kind", "cut depths", "extrapolated step s",
                      "per layer s", "full depth step s", "extrapolated / full"], rows), ""]
  return Section(lines[:-1])
