"""How the results of the Pallas kernels (tilings, per-option layer times, the offline GPU compile)
read as tables: the families of results/, registered with `benchmarks.families.family`; `python
-m benchmarks.render` assembles them."""

from __future__ import annotations

from benchmarks.families import Section, family, num, pct, table

# Layer rows measured before train.py's GPU flags (the ragged all-to-all decomposer) and the
# Hopper tiles: the decision keeps them; the current layer times are layer_profile's.
LAYER_SUPERSEDED = {"kernels_gpu.json": "0054-ragged-all-to-all-decomposed-on-gpu.md"}


@family("kernels_", "Pallas kernels and the layer per kernels / dispatch")
def _kernels(files):
  lines = []
  for name, d in files.items():
    k = [[r["kernel"], f"T={r.get('T', '')} D={r.get('D', '')} K={r.get('K', '')}",
          r["dtype"], num(r.get("fwd_ms")), num(r.get("fwd_bwd_ms"))] for r in d["kernels"]]
    layer = [[f"{r['dispatch']}:{r['kernels']}", r["mesh"], num(r["tokens"]), r["dtype"],
              num(r["fwd_bwd_ms"]), pct(r["dropped_fraction"])] for r in d["layer"]]
    lines += [f"`{name}`: {d['metadata'].get('note', '')}", "",
              *table(["kernel", "shape", "dtype", "fwd ms", "fwd+bwd ms"], k), ""]
    if name in LAYER_SUPERSEDED:
      record = LAYER_SUPERSEDED[name]
      lines += [f"Its layer rows ran before the GPU flags and tiles the layer uses now: "
                f"[decision {record[:4]}](decisions/{record}) keeps them.", ""]
    else:
      lines += [*table(["layer dispatch:kernels", "mesh", "tokens", "dtype", "fwd+bwd ms",
                        "dropped"], layer), ""]
  return Section(lines[:-1])


@family("gmm_tiles", "Grouped-matmul tilings on one GPU")
def _gmm_tiles(files):
  rows = []
  for name, d in files.items():
    best = {}
    for r in d["rows"]:
      if r.get("ms") and (r["impl"] not in best or r["ms"] < best[r["impl"]]["ms"]):
        best[r["impl"]] = r
    for impl, r in sorted(best.items(), key=lambda kv: kv[1]["ms"]):
      tiles = " x ".join(str(r[k]) for k in ("bm", "bn", "bk") if k in r)
      rows.append([impl, f"[{r['M']}, {r['K']}] x [{r['G']}, {r['K']}, {r['N']}]", tiles,
                   f"{r['ms']:.2f}", num(r["TFLOPs"], 0), f"`{name}`"])
  return Section(["The fastest setting of each implementation.", "",
                  *table(["implementation", "shape", "tiles", "ms", "TFLOP/s", "file"], rows)])


@family("gpu_gmm_sweep", "The grouped matmul's passes beside XLA's dense dot on one GPU")
def _gpu_gmm_sweep(files):
  lines = []
  for name, d in files.items():
    rows = []
    for r in d["rows"]:
      if r.get("skipped"):
        continue
      params = " ".join(f"{k}={v}" for k, v in r.get("params", {}).items())
      error = r.get("error", "")
      result = ([f"{r['ms']:.3f}", num(r["tflops"], 0), f"{r['of_dense']:.2f}"] if r.get("ms")
                else [next((w for w in error.replace(":", " ").split()
                            if w.startswith("CUDA_ERROR")), error[:60]), "", ""])
      rows.append([r["shape"], r["pass"], f"{r['rows']} x {r['d']} x {r['f']}, {r['groups']}",
                   r["impl"], params, *result])
    reasons = {}
    for r in d["rows"]:
      if r.get("skipped"):
        why = "the budget" if "budget" in r["skipped"] else "an earlier kernel's device fault"
        reasons[why] = reasons.get(why, 0) + 1
    skipped = "; ".join(f"{n} not run ({why})" for why, n in reasons.items())
    lines += [f"`{name}` ({d['metadata'].get('note', '')}): each pass of the expert "
              "up-projection at rows x d x f over its groups; the time per call inside one jit; "
              "'of dense' is XLA's dense dot of the same FLOPs over this time"
              + (f"; candidates {skipped}." if skipped else "."), "",
              *table(["shape", "pass", "rows x d x f, groups", "kernel", "tiling", "ms",
                      "TFLOP/s", "of dense"], rows), ""]
  return Section(lines[:-1])


@family("layer_profile", "The MoE layer on one GPU, per dispatch and kernels")
def _layer_profile(files):
  rows = []
  for name, d in files.items():
    for r in d["rows"]:
      rows.append([r["option"], f"{r['fwd_ms']:.1f}", f"{r['fwd_bwd_ms']:.1f}",
                   f"{r['gpu_ms_per_fwd_bwd']:.1f}", f"`{name}`"])
  return Section(table(["dispatch:kernels", "fwd ms", "fwd+bwd ms", "GPU kernel ms per fwd+bwd",
                        "file"], rows))


@family("gpu_compile", "Triton kernels compiled offline for sm_90a")
def _gpu_compile(files):
  rows = []
  for name, d in files.items():
    s = d["summary"]
    worst = max((r for r in d["rows"] if r.get("default") and r.get("registers") is not None),
                key=lambda r: r["registers"])
    rows.append([d["jax"], d["triton"],
                 f"{s['default_compiled']} of {s['default_tilings']}", s["default_spilling"],
                 f"{worst['registers']} ({worst['kernel']}, top_k {worst['top_k']})",
                 f"`{name}`"])
  return Section(table(["jax", "triton", "default tilings compiled", "spilling",
                        "most registers", "file"], rows))
