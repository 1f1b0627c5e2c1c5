"""How the results of the GPU program and the runs on a lent GPU read as tables: the families of
results/, registered with `benchmarks.families.family`; `python -m benchmarks.render` assembles
them."""

from __future__ import annotations

from benchmarks.families import Section, family, num, pct, ratio, table

# The measured error of the schedule estimate that prices every compile-only row (decisions
# 0104 and 0126): what a reader weighs each estimated step against.
ESTIMATE_ERROR = ("within 9% per category and 5% per step of the four measured H200 steps it was "
                  "fitted to, 6% per step of eight held out")


def remat_text(row: dict) -> str:
  """A row's remat column: off, on, or on with the MoE exchanges kept (the config's
  model.remat_keeps_exchange, where the layout's dispatch takes it)."""
  kept = ", exchange kept" if row.get("keeps_exchange") else ""     # fsep keeps it either way
  return ("on" if row["remat"] else "off") + kept


@family("published_mixtral", "Mixtral-8x7B on 64 H100: the cost model vs Megatron-Core")
def _published(files):
  rows, head = [], []
  for name, d in files.items():
    p = d["published"]
    for r in d["rows"]:
      rows.append([r["layout"], r["profile"], remat_text(r),
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


@family("train_step", "The GPU config's train step on one GPU")
def _train_step(files):
  rows, head = [], []
  for name, d in files.items():
    # Rows measured before train.py's GPU flags gained the decomposer are superseded
    # (decision 0054 keeps them).
    current = [r for r in d["rows"] if "before the decomposer" not in r["setting"]]
    for r in current:
      rows.append([r["dispatch:kernels"], r["setting"], num(r["tokens_per_s_median_from_step_5"],
                                                            0), f"`{name}`"])
    best = {}
    for r in current:
      best[r["dispatch:kernels"]] = max(best.get(r["dispatch:kernels"], 0),
                                        r["tokens_per_s_median_from_step_5"])
    head.append(("`gpt_moe_gpu.gin` train step on one GPU, 8 x 1024 tokens, tokens/s: "
                 "dense/xla, ragged/pallas", ", ".join(num(best[k], 0) for k in
                                                     ("dense:xla", "ragged:pallas") if k in best),
                 name))
  return Section(table(["dispatch:kernels", "setting", "tokens/s (median from step 5)",
                        "file"], rows), head)


def _estimate_vs_measured(est: dict) -> str:
  """The measured step beside the schedule estimate of its own HLO: where they disagree the
  reader sees the measurement first."""
  if not (est.get("measured_step_s") and est.get("estimated_step_s")):
    return ""
  return (f"; measured step {est['measured_step_s'] * 1e3:.1f} ms, the schedule estimate of "
          f"its HLO {est['estimated_step_s'] * 1e3:.1f} ms "
          f"({est['estimated_step_s'] / est['measured_step_s'] - 1:+.0%})")


# (step's name in the JSON, shape of benchmarks.gpu.gpu_train_step.SHAPES, what it is);
# "train_steps" is the GPU config's, its name before there were others.
ON_GPU_SHAPES = (
    ("train_mixtral_2l", "mixtral_2l",
     "Mixtral-8x7B's layer, 2 layers, 64K tokens a step (8 x 2 x 4096)"),
    ("train_qwen3_4l", "qwen3_4l",
     "Qwen3-30B-A3B's layer, 4 layers, 64K tokens a step (8 x 2 x 4096)"),
    ("train_gpu_config_ep8_slice", "gpu_config_ep8_slice",
     "the GPU config's per-GPU slice of an 8-GPU expert-parallel node (4 of 32 experts), "
     "8 x 1024 tokens"),
    ("train_steps", "gpu_config",
     "the GPU config, 8 x 1024 tokens (its batch over an 8-GPU node)"),
)


def _gpu_name(d: dict) -> str:
  m = d["metadata"]["machine"]
  return (m if isinstance(m, str) else m["device"]).split(" (")[0].replace("1 x NVIDIA ", "")


def _attention_rates(rates: dict) -> list[str]:
  rows = [[f"{a['batch']} x {a['seq']}, {a['heads']}/{a['kv_heads']} heads of {a['head_dim']}",
           a["implementation"], num(1e3 * a["fwd_s"], 2) if a.get("fwd_s") else a.get("error"),
           num(1e3 * a["fwd_bwd_s"], 2) if a.get("fwd_bwd_s") else "",
           num(a.get("fwd_bwd_flops_per_s", 0) / 1e12, 0)]
          for a in rates.get("attention", [])]
  if not rows:
    return []
  return ["Causal attention by implementation (bf16; model FLOPs of the causal half, the "
          "backward 2.5x the forward):", "",
          *table(["batch x seq, q/kv heads of dim", "kernel", "fwd ms", "fwd+bwd ms",
                  "fwd+bwd TFLOP/s"], rows), ""]


@family("on_gpu", "The prepared GPU run: train steps of the shapes people train on one GPU")
def _on_gpu(files):
  lines, head = [], []
  for name, d in files.items():
    gpu = _gpu_name(d)
    for step, shape, what in ON_GPU_SHAPES:
      train = d["steps"].get(step, {})
      if not train.get("rows"):
        continue
      rows = [[r["path"], r.get("attention", ""), r.get("loss_chunk", ""),
               num(r.get("tokens_per_s"), 0), pct(r.get("mfu"), 1),
               num(1e3 * r["step_s_median"], 1) if r.get("step_s_median") else r.get("error", "")]
              for r in train.get("rows", []) + train.get("ablations", [])]
      lines += [f"`{name}`, {what}: median of "
                f"{max((r.get('steps_timed', 0) for r in train['rows']), default=0)} "
                "interleaved steps per path; MFU at the bf16 dense peak, model FLOPs only.", "",
                *table(["path", "attention", "loss tile", "tokens/s", "MFU", "step ms"], rows),
                ""]
      if train.get("best"):
        best = next(r for r in train["rows"] if r["path"] == train["best"])
        est = next((e for e in d["steps"].get("schedule_estimate", {}).get("rows", [])
                    if e["shape"] == shape), None)
        if step == "train_steps" and "rows" not in d["steps"].get("schedule_estimate", {}):
          est = d["steps"]["schedule_estimate"]   # one shape's run: the estimate was one row
        head.append((f"{what[0].upper()}{what[1:]}, on one {gpu}: fastest MoE path "
                     f"({best['path']}) vs the dense-equivalent model",
                     f"{num(best['tokens_per_s'], 0)} tokens/s, MFU {pct(best.get('mfu'), 1)}; "
                     f"{ratio(train['best_vs_dense_equivalent'])} the dense-equivalent's"
                     + _estimate_vs_measured(est or {}), name))
    lines += _attention_rates(d["steps"].get("rates", {}))
    tests = d["steps"].get("kernel_tests", {}).get("counts")
    if tests:
      lines += [f"Kernel tests on the GPU: {', '.join(f'{v} {k}' for k, v in tests.items())}.",
                ""]
    mock = d["steps"].get("mock_topology", {}).get("rows", [])
    if mock:
      lines += [*table(["mocked topology", "strategy", "result"],
                       [[m["topology"], m["strategy"],
                         (m.get("error") or m.get("skipped") or
                          f"compiled in {m['compile_s']:.0f} s")[:120]] for m in mock]), ""]
  return Section(lines[:-1], head)


@family("gpu_program", "The GPU program per strategy, compiled for compile-only H100s")
def _gpu_program(files):
  rows = []
  for name, d in files.items():
    for r in d["rows"]:
      gpus = 1
      for n in r["topology"].split("x"):
        gpus *= int(n)
      label = r["family"] + (" (remat off)" if "model.remat = False" in r.get("bindings", [])
                             else "") + (" (verified pick)" if r.get("verified_pick") else "")
      if not r.get("compiled"):
        rows.append([label, f"`{r['spec']}`", gpus, "not compiled", "", "", "", "", f"`{name}`"])
        continue
      err = r.get("memory_model_error")
      rows.append([label, f"`{r['spec']}`", gpus,
                   f"{r['peak_bytes'] / 2**30:.2f} ({r['model_memory_bytes'] / 2**30:.2f})",
                   "" if err is None else f"{err:+.1%}",
                   f"{r['overlapped_bytes_fraction']:.3f}", f"{r['exposed_comm_s'] * 1e3:.1f}",
                   f"{r['step_s'] * 1e3:.1f} ({r['model_step_s'] * 1e3:.1f})", f"`{name}`"])
  head = []
  for name, d in files.items():
    fsep = [r for r in d["rows"] if r.get("compiled") and r["family"] == "fsep_planned" and
            "model.remat = False" not in r.get("bindings", [])]
    if fsep:
      head.append(("fsep on compile-only H100s (XLA:GPU's schedule): overlapped collective "
                   "bytes, exposed communication, estimated step (the schedule estimate, "
                   f"{ESTIMATE_ERROR}), per GPU count",
                   "; ".join(f"{_gpus(r)} GPUs: {r['overlapped_bytes_fraction']:.2f}, "
                             f"{r['exposed_comm_s'] * 1e3:.1f} ms, {r['step_s'] * 1e3:.0f} ms"
                             for r in fsep), name))
    errors = [r["memory_model_error"] for r in d["rows"] if "memory_model_error" in r]
    if errors:
      head.append(("memory model vs XLA:GPU's peak per GPU, compiled strategies: within 10%, "
                   "largest error",
                   f"{sum(abs(e) <= 0.10 for e in errors)} of {len(errors)}, "
                   f"{max(errors, key=abs):+.1%}", name))
    head += _mixtral_head(name, d)
  return Section(["XLA:GPU's program of the GPU config's strategy families (and Mixtral-8x7B at "
                  "the plan's top candidates, the fastest that fits marked), compiled on a CPU "
                  "host: XLA's peak memory per GPU "
                  "beside the memory model's, the share of collective bytes overlapped with "
                  "compute, and the schedule estimate of the exposed communication and the "
                  "step beside the cost model's (docs/guide/gpu-program.md).", "",
                  *table(["family", "spec", "GPUs", "XLA peak GiB (model)", "model err",
                          "overlapped",
                          "exposed comm ms", "step ms, schedule (cost model)", "file"], rows)],
                 head)


def _mixtral_head(name: str, d: dict) -> list:
  """Mixtral-8x7B's schedule estimate beside Megatron-Core's published step, with the parts
  of the model that take the most of the estimate's compute."""
  found = [r for r in d["rows"] if r["family"] == "mixtral_8x7b_plan" and r.get("compiled")
           and r.get("published")]
  if not found:
    return []
  # the verified pick: the fastest of the plan's top candidates compiled (rows written
  # before candidates were compiled: the one row, the plan's pick)
  r = next((f for f in found if f.get("verified_pick")), found[0])
  first = next((f for f in found if f.get("plan_order") == 0), r)
  parts = sorted(r.get("compute_s_by", {}).items(), key=lambda kv: -kv[1])[:2]
  # a compile-only program has XLA's unfused attention (no cuDNN to build); the schedule
  # estimate costs it as the fused kernel a GPU runs (moejax.aot.estimate)
  what = ", ".join(f"{k} {v:.2f} s" + (" (the compile-only program's unfused attention, "
                                        "costed as cuDNN's fused kernel)"
                                        if k == "attention core" and
                                        r.get("attention") == "xla" else "")
                   for k, v in parts)
  published = r["published"]["step_s"]
  picked = (f"the fastest of the plan's {len(found)} best compiled, `{r['spec']}`; the cost "
            f"model's first, `{first['spec']}`, {first['step_s']:.2f} s" if first is not r else
            f"its plan's strategy, `{r['spec']}`")
  return [(f"Mixtral-8x7B on {_gpus(r)} compile-only H100s ({picked}): estimated step (the "
           f"schedule estimate, {ESTIMATE_ERROR}) vs Megatron-Core's published "
           f"{published:.2f} s",
           f"{r['step_s']:.2f} s, {r['step_s'] / published:.2f}x; compute "
           f"{r['compute_s']:.2f} s: {what}; exposed communication "
           f"{r['exposed_comm_s']:.2f} s", name)]


def _gpus(row) -> int:
  gpus = 1
  for n in row["topology"].split("x"):
    gpus *= int(n)
  return gpus


def _ms(seconds: float) -> str:
  ms = 1e3 * seconds
  return f"{ms:.0f} ms" if abs(ms) >= 10 else f"{ms:.1f} ms"


# The code levers' names beside the old path each "before" row puts back.
CODE_LEVERS = {"scatter_backward": ("gather backward", "scatter backward"),
               "recompute_loss": ("fused linear cross-entropy", "recompute loss"),
               "pipelined_microbatches": ("microbatches accumulated in place",
                                          "one-stage pipeline")}


def _code_levers(rows: list[dict]) -> list[dict]:
  """Per row with an old path put back ("before"): the row at the same bindings with the
  library's path, and the step the library's path saves."""
  after = {(r["shape"], r["lever"], r["path"]): r for r in rows
           if "before" not in r and "estimated_step_s" in r}
  out = []
  for r in rows:
    if "before" not in r or "estimated_step_s" not in r:
      continue
    lever, suffix = CODE_LEVERS[r["before"]]
    at = r["lever"][:-len(suffix)].rstrip(", ") or "as configured"
    new = after.get((r["shape"], at, r["path"]))
    if new is not None:
      out.append({"shape": r["shape"], "lever": lever, "at": at, "path": r["path"],
                  "old_s": r["estimated_step_s"], "new_s": new["estimated_step_s"],
                  "saved_s": r["estimated_step_s"] - new["estimated_step_s"]})
  return out


@family("gpu_levers", "Levers of the one-GPU step, in the program XLA:GPU compiles (H200)")
def _gpu_levers(files):
  lines, head, heads = [], [], {}
  for name, d in files.items():
    rows = []
    for r in d["rows"]:
      if "error" in r or "skipped" in r:
        rows.append([r["shape"], r["lever"], r["path"], "", "", "", "", "", "", "",
                     (r.get("error") or r.get("skipped"))[:90]])
        continue
      mfu = r["model_flops"] / (r["estimated_step_s"] * 989e12)
      rows.append([r["shape"], r["lever"], r["path"], num(1e3 * r["estimated_step_s"], 1),
                   pct(mfu, 1), num(int(r["kernels"])),
                   f"{r['gemm_flops'] / r['model_flops']:.2f}",
                   num(r["loop_convert_bytes"] / 1e9, 1),
                   num(r["loop_fill_bytes"] / 1e9, 1) if "loop_fill_bytes" in r else "",
                   num(int(r["scatter_kernels"])), num(r["temp_bytes"] / 2**30, 1)])
    lines += [f"`{name}`: the schedule estimate ({ESTIMATE_ERROR}) of each program compiled for "
              "one compile-only H200; estimated MFU at the bf16 peak, model FLOPs only; GEMM "
              "FLOPs executed over the model's (remat, capacity padding, and in the rows that "
              "put the recomputing loss back its recomputed logits); XLA's temp memory holds "
              "the unfused attention scores a GPU's cuDNN kernel does not.", "",
              *table(["shape", "lever", "path", "est. step ms", "est. MFU", "kernels",
                      "GEMM / model FLOPs", "loop convert GB", "loop fill GB",
                      "scatter kernels", "temp GiB"], rows), ""]
    before = _code_levers(d["rows"])
    if before:
      lines += ["Each code lever alone: the estimated step with the old path put back "
                "(`benchmarks/gpu/before.py`) less the step with the library's, at the same "
                "bindings.", "",
                *table(["shape", "lever", "at", "path", "old path ms", "library ms", "saves ms"],
                       [[b["shape"], b["lever"], b["at"], b["path"], num(1e3 * b["old_s"], 1),
                         num(1e3 * b["new_s"], 1), num(1e3 * b["saved_s"], 1)]
                        for b in before]), ""]
    for shape in dict.fromkeys(r["shape"] for r in d["rows"]):
      code = [((b["lever"], b["at"]), f"{b['lever']} alone {_ms(b['saved_s'])}" + (
                   f" at {b['at']}" if b["at"] != "as configured" else " as configured"))
              for b in before if b["shape"] == shape and b["path"] != "dense_equivalent"]
      levers = {r["lever"] for r in d["rows"] if "before" not in r}
      saved = [s for s in d["savings"] if s["shape"] == shape and s["path"] != "dense_equivalent"
               and s["lever"] != "as configured" and s["lever"] in levers]
      base = next((s for s in d["savings"] if s["shape"] == shape and
                   s["lever"] == "as configured" and s["path"] != "dense_equivalent"), None)
      best = max(saved, key=lambda s: s["saved_s"]) if saved else None
      # the README's headline keeps the shapes whose best lever moves the MoE/dense ratio as
      # printed (two decimals); the others stay in the full table
      if base is None or best is None or ratio(base["moe_over_dense_throughput"]) == ratio(
          best["moe_over_dense_throughput"]):
        continue
      what = (f"{best['lever']}: {_ms(best['saved_s'])} a step; "
              f"{ratio(base['moe_over_dense_throughput'])} -> "
              f"{ratio(best['moe_over_dense_throughput'])}" if best else "")
      heads.setdefault(shape, []).append((d["metadata"]["date"], name, what, code))
  # one headline a shape: the newest file's best lever, each code lever (at its bindings) from
  # the newest file that prices it
  for shape, found in heads.items():
    _, name, what, _ = max(found)
    newest = {}
    for _, _, _, code in sorted(found, reverse=True):
      for key, text in code:
        newest.setdefault(key, text)
    code = "; ".join(newest.values())
    head.append((f"{shape} on one compile-only H200, the schedule estimate ({ESTIMATE_ERROR}): "
                 "best lever's saving; MoE tokens/s over the dense twin's, as configured -> "
                 "with it; each code lever's saving alone (the old path put back)",
                 "; ".join(x for x in (what, code) if x), name))
  return Section(lines[:-1], head)


@family("loss_parity", "Loss parity of the one-GPU step's levers that change numerics (CPU)")
def _loss_parity(files):
  lines, head = [], []
  for name, d in files.items():
    tail = d["tail"]
    rows = [[s["job"], s["run"], s["reference"], f"{s['final_loss']:.4f}",
             f"{s['reference_final_loss']:.4f}", f"{s['final_diff']:+.4f}",
             f"{s['max_abs_diff_tail']:.4f}", f"{s['tail_mean_diff']:+.4f}",
             f"{s['noise']['tail_mean_diff']:+.4f}" if s["noise"] else "",
             {True: "yes", False: "no", None: ""}[s["within_noise"]]]
            for s in d["summary"]]
    steps = ", ".join(f"{r['job']} {r['steps']}" for r in d["rows"]
                      if r["reference"] is None)
    lines += [f"`{name}`: each run's loss curve through the trainer on CPU (steps: {steps}) "
              "against its reference, the same job and seeds without the lever; the noise is "
              "the reference job at another initialisation seed (train.seed 1) against the "
              f"same reference. Differences over the last {tail} steps.", "",
              *table(["job", "run", "reference", "final loss", "reference's", "final diff",
                      f"max abs diff, last {tail}", f"mean diff, last {tail}",
                      "seed noise, mean diff", "within noise"], rows), ""]
    jobs = []
    for job in dict.fromkeys(s["job"] for s in d["summary"]):
      runs = [s for s in d["summary"] if s["job"] == job and s["within_noise"] is not None]
      if runs:
        jobs.append(f"{job}: " + ", ".join(f"{s['run']} {s['tail_mean_diff']:+.4f}"
                                           for s in runs) +
                    f" (noise {runs[0]['noise']['tail_mean_diff']:+.4f})")
    if jobs:
      head.append((f"Loss parity on CPU: mean loss over the last {tail} steps, the lever's run "
                   "less the same run without it (noise: the baseline at another seed less "
                   "the baseline)", "; ".join(jobs), name))
  return Section(lines[:-1], head)
