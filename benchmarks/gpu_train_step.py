"""The GPU config's train step on one GPU, measured through the trainer's own programs:
every dispatch path and the dense-equivalent model built from `configs/gpt_moe_gpu.gin` at the
per-GPU batch of an 8-GPU node, timed interleaved, with model-FLOP MFU and a kernel profile of
the fastest. `benchmarks.on_gpu` runs it in a process of its own (`train_child`)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time

GPU_CONFIG = "configs/gpt_moe_gpu.gin"
PER_GPU_BATCH = 8                    # the GPU config's global 64 over one 8-GPU node
# Dense bf16 peak FLOP/s by device kind (NVIDIA's data sheets, without sparsity).
PEAK_BF16 = {"H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "H100 PCIe": 756e12,
             "H100 NVL": 835e12, "H200": 989e12}
# (name, bindings): the paths measured side by side; the first group must fit together.
PATHS = (
    ("dense/xla", {"moe.dispatch": "dense", "moe.kernels": "xla"}),
    ("ragged/pallas", {"moe.dispatch": "ragged", "moe.kernels": "pallas"}),
    ("pooled/pallas", {"moe.dispatch": "dense", "moe.kernels": "pallas", "moe.capacity": "device"}),
    ("fsep/xla", {"moe.expert_mode": "fsep", "moe.dispatch": "dense", "moe.kernels": "xla"}),
    ("dense_equivalent", {"moe.dense_equivalent": True, "moe.dispatch": "dense",
                          "moe.kernels": "xla"}),
)
# What the tiled loss and the fused attention are worth, on the fastest MoE path.
ABLATIONS = (("plain loss", {"model.loss_chunk": 0}), ("xla attention", {"model.attention": "xla"}),
             ("no remat", {"model.remat": False}))
def with_bindings(cfg, bindings: dict):
  """`cfg` with 'section.field' bindings applied."""
  for key, value in bindings.items():
    section, field = key.split(".")
    cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                   **{field: value})})
  return cfg


def load_config(dry_run: bool, devices: int):
  """The GPU config at `devices` x the per-GPU batch (dry run: a tiny model of its shape)."""
  from moejax.frontend import parse_config
  cfg = parse_config([GPU_CONFIG], [])
  cfg = with_bindings(cfg, {"mesh.data": -1, "mesh.expert": min(devices, cfg.mesh.expert),
                    "mesh.host_device_count": 1,
                    "data.global_batch_size": PER_GPU_BATCH * devices, "data.path": None,
                    "checkpoint.every": 10**9, "train.tensorboard": False})
  if dry_run:
    cfg = with_bindings(cfg, {"model.vocab_size": 512, "model.d_model": 32, "model.num_heads": 4,
                      "model.d_ff": 64, "model.num_layers": 2, "model.max_seq_len": 64,
                      "moe.num_experts": 4, "moe.d_ff": 32, "data.seq_len": 64,
                      "data.global_batch_size": 2 * devices, "model.loss_chunk": 16})
  return cfg.validate()


def flops_per_token(cfg) -> float:
  """Model FLOPs of one training token (forward + backward = 3x forward; remat's recompute
  not counted): 6 x the active matmul parameters, plus causal attention's 6 x Q x D a layer."""
  from moejax.config import num_moe_layers
  m, moe = cfg.model, cfg.moe
  d, q = m.d_model, cfg.data.seq_len
  moe_layers = num_moe_layers(m, moe)
  dense_layers = m.num_layers - moe_layers
  expert_width = moe.top_k * moe.d_ff + moe.num_shared_experts * (moe.shared_d_ff or moe.d_ff)
  params = (m.num_layers * 4 * d * d + dense_layers * 3 * d * m.d_ff +
            moe_layers * (3 * d * expert_width + (0 if moe.dense_equivalent else d *
                                                  moe.num_experts)) + d * m.vocab_size)
  return 6 * params + 6 * m.num_layers * q * d


class Budget:
  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds

  def left(self) -> float:
    return self.end - time.monotonic()


def _programs(base, paths):
  """[(name, program, state, build_s, error)]: the trainer's own programs and fresh states;
  the train steps are compiled in parallel threads (XLA's compile and autotuning release the
  GIL), a path that fails to build or compile is reported with its one-line error."""
  from concurrent.futures import ThreadPoolExecutor

  import jax

  from moejax.strategy.spec import from_config
  from moejax.train import optim
  from moejax.train.programs import build_program
  from moejax.train.state import init_state
  devices = jax.devices()[:1]

  def one(name_bindings):
    name, bindings = name_bindings
    tick = time.perf_counter()
    try:
      cfg = with_bindings(base, bindings).validate()
      tx = optim.optimizer(cfg.optim, cfg.train.num_steps)
      prog = build_program(cfg, from_config(cfg, 1), tx,
                           optim.schedule(cfg.optim, cfg.train.num_steps), devices)
      state = init_state(prog.model, tx, prog.shardings, prog.layout,
                         cfg.data.global_batch_size, cfg.data.seq_len, 0)
      return name, prog, state, time.perf_counter() - tick, None
    except Exception as e:    # one path failing (memory, a CPU-only limit) is a result
      why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
      if bindings.get("model.attention") is None and "cudnn" in why.lower():
        # the fused attention failing must not cost the whole measurement
        name, prog, state, _, err = one((name, {**bindings, "model.attention": "xla"}))
        return name, prog, state, time.perf_counter() - tick, err or f"cudnn failed: {why}"
      return name, None, None, time.perf_counter() - tick, why

  with ThreadPoolExecutor(max_workers=len(paths)) as pool:
    return list(pool.map(one, paths))


def _batch(prog, seed):
  import jax
  import numpy as np
  cfg = prog.cfg
  tokens = np.random.default_rng(seed).integers(
      0, cfg.model.vocab_size, (cfg.data.global_batch_size, cfg.data.seq_len + 1), np.int32)
  return jax.device_put(tokens, prog.batch_sharding)


def time_interleaved(built, rounds: int, steps: int, budget: Budget) -> dict:
  """Median step seconds per path over `rounds` x `steps` timed steps after one warm-up
  step each; the paths take turns every round (one machine state for all)."""
  import jax
  import numpy as np
  live = {name: [prog, state] for name, prog, state, _, _ in built if prog is not None}
  times = {name: [] for name in live}
  losses = {}
  batches = {name: _batch(prog, 0) for name, (prog, _) in live.items()}
  for r in range(rounds + 1):
    for name, slot in live.items():
      prog, state = slot
      for _ in range(1 if r == 0 else steps):
        tick = time.perf_counter()
        state, metrics = prog.train_step(state, batches[name], prog.layout)
        jax.block_until_ready(state)
        if r:
          times[name].append(time.perf_counter() - tick)
      slot[1] = state
      losses[name] = float(metrics["loss"])
    if budget.left() < 30:
      break
  timed = {name: {"step_s_median": float(np.median(t)) if t else None, "steps_timed": len(t),
                  "step_s_all": [round(x, 6) for x in t], "loss_last": losses.get(name)}
           for name, t in times.items()}
  return timed, {name: slot[1] for name, slot in live.items()}   # the states, not donated


def _profile(prog, state, steps: int = 3, top: int = 25) -> dict:
  """GPU kernel time by kernel name over `steps` traced steps (JAX's profiler)."""
  import tempfile

  import jax

  from benchmarks.layer_profile import gpu_kernels
  logdir = tempfile.mkdtemp(prefix="on_gpu_trace_")
  batch = _batch(prog, 1)
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for _ in range(steps):
      state, _ = prog.train_step(state, batch, prog.layout)
    jax.block_until_ready(state)
  ms = gpu_kernels(logdir, steps)
  return {"state": state, "steps": steps, "gpu_busy_us_per_step": 1e3 * sum(ms.values()),
          "top_kernels_us_per_step": [[n, round(1e3 * v, 1)] for n, v in ms.most_common(top)]}


def step_train(cfg, dry_run: bool, budget: Budget, out: str, peak: float | None):
  """(result, the fastest MoE path's scheduled HLO, its row)."""
  rounds, steps = (2, 2) if dry_run else (4, 4)
  tokens = cfg.data.global_batch_size * cfg.data.seq_len

  def rows_of(built, timed):
    rows = []
    for name, prog, _, build_s, err in built:
      row = {"path": name, "build_s": round(build_s, 1), "error": err}
      if prog is not None:
        t = timed[name]
        fpt = flops_per_token(prog.cfg)
        row.update(t, attention=prog.cfg.model.attention, loss_chunk=prog.cfg.model.loss_chunk,
                   flops_per_token=fpt)
        if t["step_s_median"]:
          row["tokens_per_s"] = tokens / t["step_s_median"]
          row["mfu"] = fpt * row["tokens_per_s"] / peak if peak else None
      rows.append(row)
    return rows

  built = _programs(cfg, PATHS)
  timed, states = time_interleaved(built, rounds, steps, budget)
  rows = rows_of(built, timed)
  result = {"tokens_per_step": tokens, "peak_flops": peak, "rows": rows}
  moe_rows = [r for r in rows if r.get("tokens_per_s") and r["path"] != "dense_equivalent"]
  dense = next((r for r in rows if r["path"] == "dense_equivalent" and r.get("tokens_per_s")),
               None)
  best = max(moe_rows, key=lambda r: r["tokens_per_s"], default=None)
  if best is None:
    return result, None, None
  result["best"] = best["path"]
  if dense:
    result["best_vs_dense_equivalent"] = best["tokens_per_s"] / dense["tokens_per_s"]
  kept = next(b for b in built if b[0] == best["path"])
  kept = kept[:2] + (states[best["path"]],) + kept[3:]
  del built, states                           # frees the other paths' states
  hlo = kept[1].train_step.as_text()
  if budget.left() > 60:
    try:
      result["profile"] = _profile(kept[1], kept[2])
      kept = kept[:2] + (result["profile"].pop("state"),) + kept[3:]
    except Exception as e:
      result["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  if budget.left() > (40 if dry_run else 150):
    try:
      base = dict(PATHS)[best["path"]]
      abl = [kept] + _programs(cfg, [(f"{best['path']}, {n}", {**base, **b})
                                     for n, b in ABLATIONS] +
                             [("dense_equivalent, no remat",
                               {**dict(PATHS)["dense_equivalent"], "model.remat": False})])
      result["ablations"] = rows_of(abl, time_interleaved(abl, rounds, steps, budget)[0])
    except Exception as e:
      result["ablations"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  return result, hlo, best


def train_child(path: str, out: str, budget_s: str, dry_run: str) -> None:
  """The train-step measurement, in its own process: its result and the fastest path's
  scheduled HLO (gzipped, beside the JSON) go to `path`."""
  import jax
  dev = jax.devices()[0]
  peak = next((v for k, v in PEAK_BF16.items() if k in dev.device_kind), None)
  result, hlo, best = step_train(load_config(dry_run == "1", 1), dry_run == "1",
                                 Budget(float(budget_s)), out, peak)
  name = None
  if hlo is not None:
    name = "best_step_hlo.txt.gz"
    with gzip.open(os.path.join(out, name), "wt") as f:
      f.write(hlo)
  with open(path, "w") as f:
    json.dump({"result": result, "best": best, "hlo": name}, f)


