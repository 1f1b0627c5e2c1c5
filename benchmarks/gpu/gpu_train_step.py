"""Train steps on one GPU, measured through the trainer's own programs: for each shape in
`SHAPES` (the GPU config at the per-GPU batch of an 8-GPU node and its per-GPU expert slice; a
Mixtral-8x7B and a Qwen3-30B-A3B shape cut to the layers one GPU holds, at a Megatron-like
64K tokens per optimizer step by gradient accumulation), its MoE paths and its dense-equivalent
model timed interleaved, with model-FLOP MFU and the fastest path's whole kernel profile.
`benchmarks.gpu.on_gpu` runs each shape in a process of its own (`train_child`)."""

from __future__ import annotations

import dataclasses
import gzip
import json
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

@dataclasses.dataclass(frozen=True)
class Shape:
  """A measured config: a gin file, bindings over it, the paths timed side by side, the
  ablations of the fastest path, and the levers: (name, bindings, moe_only) each timed as the
  fastest MoE path beside the dense-equivalent (moe_only: the MoE path alone, a lever the
  dense model does not have) under the bindings, with its kernel table and HLO."""
  gin: str
  bindings: dict
  paths: tuple
  ablations: tuple = ()
  levers: tuple = ()


_DENSE = PATHS[0]
_DENSE_EQ = PATHS[-1]
# 64K tokens per optimizer step as 8 accumulated microbatches of 2 x 4096; the tiled loss at
# 512 positions a tile (a [512, vocab] fp32 tile rather than the whole [8192, vocab] logits).
_BIG_STEP = {"data.seq_len": 4096, "data.global_batch_size": 16, "train.microbatches": 8,
             "model.loss_chunk": 512}
# Each microbatch re-reads, converts and accumulates every weight and gradient (the first
# H200 profile of the Mixtral cut: about 240 of its 1178 ms); the remat recomputes each
# layer's forward matmuls, and one GPU's 141 GB hold the activations without it (cuDNN's
# attention keeps no scores). A lower capacity factor is no lever here: it drops tokens the
# dense twin keeps.
_MICRO2 = {"train.microbatches": 2}
_BIG_LEVERS = (("microbatches 2", _MICRO2, False),
               ("microbatches 2, no remat", {**_MICRO2, "model.remat": False}, False),
               ("microbatches 2, bf16 moments", {**_MICRO2, "optim.moments_dtype": "bfloat16"},
                False))
# Under remat, the MoE exchanges' outputs kept or recomputed (configs/mixtral_8x7b.gin keeps
# them, configs/qwen3_moe.gin does not): each shape tries the other choice.
_KEEPS = ("exchange kept", {"model.remat_keeps_exchange": True}, True)
_RECOMPUTES = ("exchange recomputed", {"model.remat_keeps_exchange": False}, True)
SHAPES = {
    # Mixtral-8x7B's layer (d 4096, GQA 32/8, 8 experts of 14336, top-2), 2 layers: ~3.1B
    # parameters, whose fp32 state and Adam moments (~37 GB) leave room for the dense twin.
    "mixtral_2l": Shape("configs/mixtral_8x7b.gin", {"model.num_layers": 2, **_BIG_STEP},
                        (_DENSE, _DENSE_EQ), levers=_BIG_LEVERS + (_RECOMPUTES,)),
    # Qwen3-30B-A3B's layer (d 2048, GQA 32/4 of dim 128, QK-norm, 128 experts of 768, top-8),
    # 4 layers: ~3.1B parameters, 0.6B of them the 151936-token embedding and head.
    "qwen3_4l": Shape("configs/qwen3_moe.gin", {"model.num_layers": 4, **_BIG_STEP},
                      (_DENSE, PATHS[1], _DENSE_EQ), levers=_BIG_LEVERS + (_KEEPS,)),
    # One GPU's share of an 8-GPU expert-parallel node: E/8 = 4 experts a layer, the node's
    # tokens per GPU; the exchange is left out, the optimizer's share is the one a user sees.
    "gpu_config_ep8_slice": Shape(GPU_CONFIG, {"moe.num_experts": 4}, (_DENSE, _DENSE_EQ),
                                  levers=(("bf16 moments", {"optim.moments_dtype": "bfloat16"},
                                           False),)),
    "gpu_config": Shape(GPU_CONFIG, {}, PATHS, ABLATIONS),
}


def with_bindings(cfg, bindings: dict):
  """`cfg` with 'section.field' bindings applied."""
  for key, value in bindings.items():
    section, field = key.split(".")
    cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                   **{field: value})})
  return cfg


def load_config(dry_run: bool, devices: int, shape: str = "gpu_config"):
  """`shape`'s config at `devices` x its per-GPU batch (dry run: a tiny model of its kind:
  its head grouping, QK-norm, microbatches and layer pattern, small widths)."""
  from moejax.frontend import parse_config
  spec = SHAPES[shape]
  cfg = parse_config([spec.gin], [])
  cfg = with_bindings(cfg, {"mesh.data": -1, "mesh.expert": min(devices, cfg.mesh.expert),
                    "mesh.host_device_count": 1,
                    "data.global_batch_size": PER_GPU_BATCH * devices, "data.path": None,
                    "checkpoint.every": 10**9, "train.tensorboard": False,
                    "model.max_seq_len": max(cfg.model.max_seq_len,
                                             spec.bindings.get("data.seq_len", 0))})
  cfg = with_bindings(cfg, spec.bindings)
  if "data.global_batch_size" in spec.bindings:
    cfg = with_bindings(cfg, {"data.global_batch_size": cfg.data.global_batch_size * devices})
  if dry_run:
    m = cfg.model
    cfg = with_bindings(cfg, {"model.vocab_size": 512, "model.d_model": 32, "model.num_heads": 4,
                      "model.num_kv_heads": 2 if m.num_kv_heads else 0,
                      "model.head_dim": 16 if m.head_dim else 0,
                      "model.d_ff": 64, "model.num_layers": cfg.moe.moe_every * 2,
                      "model.max_seq_len": 64, "moe.num_experts": min(cfg.moe.num_experts, 8),
                      "moe.top_k": min(cfg.moe.top_k, 2), "moe.d_ff": 32, "data.seq_len": 64,
                      "data.global_batch_size": 2 * cfg.train.microbatches * devices,
                      "model.loss_chunk": 16})
  return cfg.validate()


def flops_per_token(cfg) -> float:
  """Model FLOPs of one training token (forward + backward = 3x forward; remat's recompute
  not counted): 6 x the active matmul parameters, plus causal attention's 6 x Q x H x Dh a
  layer (scores and values over the causal half). The projections count grouped k/v heads
  and a head dim apart from d_model / H."""
  from moejax.config import num_moe_layers
  m, moe = cfg.model, cfg.moe
  d, q = m.d_model, cfg.data.seq_len
  width = m.num_heads * (m.head_dim or d // m.num_heads)          # H x Dh
  kv_width = (m.num_kv_heads or m.num_heads) * (m.head_dim or d // m.num_heads)
  attn = 2 * d * width + 2 * d * kv_width                        # q, o; k, v
  moe_layers = num_moe_layers(m, moe)
  dense_layers = m.num_layers - moe_layers
  expert_width = moe.top_k * moe.d_ff + moe.num_shared_experts * (moe.shared_d_ff or moe.d_ff)
  params = (m.num_layers * attn + dense_layers * 3 * d * m.d_ff +
            moe_layers * (3 * d * expert_width + (0 if moe.dense_equivalent else d *
                                                  moe.num_experts)) + d * m.vocab_size)
  return 6 * params + 6 * m.num_layers * q * width


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
  step each (fewer rounds where the budget runs out, never fewer than one); the paths take
  turns every round (one machine state for all)."""
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
    if r and budget.left() < 30:   # one timed round always: a row without a time says nothing
      break
  timed = {name: {"step_s_median": float(np.median(t)) if t else None, "steps_timed": len(t),
                  "step_s_all": [round(x, 6) for x in t], "loss_last": losses.get(name)}
           for name, t in times.items()}
  return timed, {name: slot[1] for name, slot in live.items()}   # the states, not donated


def kernel_table(trace_dir: str, steps: int) -> dict:
  """Every GPU kernel of the Perfetto trace under `trace_dir`, per step: time and launches by
  (kernel, HLO op, module), the busy time (the union of kernel intervals over all streams) and
  the span from the first kernel's start to the last one's end, whose difference is idle."""
  import glob
  files = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)
  if not files:
    return {"error": f"no Perfetto trace under {trace_dir}"}
  with gzip.open(files[0]) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
         and "gpu" in e["args"]["name"].lower()}
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
  if not kernels:
    return {"error": "the trace has no GPU kernels"}
  table: dict = {}
  for e in kernels:
    args = e.get("args") or {}
    key = (e["name"][:160], str(args.get("hlo_op", ""))[:160],
           str(args.get("hlo_module", ""))[:80])
    row = table.setdefault(key, [0.0, 0])
    row[0] += e.get("dur", 0) / steps
    row[1] += 1 / steps
  spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels)
  busy, (start, end) = 0.0, spans[0]
  for s0, s1 in spans[1:]:
    if s0 > end:
      busy, start, end = busy + end - start, s0, s1
    else:
      end = max(end, s1)
  busy += end - start
  return {"steps": steps, "busy_us_per_step": busy / steps,
          "span_us_per_step": (spans[-1][1] - spans[0][0]) / steps,
          "kernel_us_per_step": sum(r[0] for r in table.values()),
          "launches_per_step": sum(r[1] for r in table.values()),
          "args_seen": sorted({k for e in kernels[:50] for k in (e.get("args") or {})}),
          "kernels": sorted(([n, op, mod, round(us, 2), round(c, 2)]
                             for (n, op, mod), (us, c) in table.items()),
                            key=lambda r: -r[3])}


def _profile(prog, state, steps: int = 3, top: int = 25) -> dict:
  """GPU kernel time over `steps` traced steps (JAX's profiler): the top kernels by name, and
  the whole table (`kernel_table`) under "table"."""
  import tempfile

  import jax

  logdir = tempfile.mkdtemp(prefix="on_gpu_trace_")
  batch = _batch(prog, 1)
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for _ in range(steps):
      state, _ = prog.train_step(state, batch, prog.layout)
    jax.block_until_ready(state)
  table = kernel_table(logdir, steps)
  by_name: dict = {}
  for name, _, _, us, _ in table.get("kernels", []):
    by_name[name[:90]] = by_name.get(name[:90], 0.0) + us
  top_names = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
  return {"state": state, "steps": steps, "gpu_busy_us_per_step": sum(by_name.values()),
          "top_kernels_us_per_step": [[n, round(v, 1)] for n, v in top_names], "table": table}


def step_train(cfg, dry_run: bool, budget: Budget, out: str, peak: float | None,
               shape: str = "gpu_config", levers_only: bool = False):
  """(result, the fastest MoE path's scheduled HLO, its row, {lever: its HLO}).
  `levers_only`: the levers alone, on the first MoE path, without the paths' rows."""
  spec = SHAPES[shape]
  rounds, steps = (2, 2) if dry_run else (4, 4) if spec.ablations else (3, 3)
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

  if levers_only:
    result = {"tokens_per_step": tokens, "peak_flops": peak, "rows": []}
    levers, hlos = _levers(cfg, spec, spec.paths[0][0], rows_of, rounds, steps, budget,
                           dry_run)
    return {**result, "levers": levers}, None, None, hlos
  built = _programs(cfg, spec.paths)
  timed, states = time_interleaved(built, rounds, steps, budget)
  rows = rows_of(built, timed)
  result = {"tokens_per_step": tokens, "peak_flops": peak, "rows": rows}
  moe_rows = [r for r in rows if r.get("tokens_per_s") and r["path"] != "dense_equivalent"]
  dense = next((r for r in rows if r["path"] == "dense_equivalent" and r.get("tokens_per_s")),
               None)
  best = max(moe_rows, key=lambda r: r["tokens_per_s"], default=None)
  if best is None:
    return result, None, None, {}
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
  abl = []
  if spec.ablations and budget.left() > (40 if dry_run else 150):
    try:
      base = dict(PATHS)[best["path"]]
      abl = [kept] + _programs(cfg, [(f"{best['path']}, {n}", {**base, **b})
                                     for n, b in spec.ablations] +
                             [("dense_equivalent, no remat",
                               {**dict(PATHS)["dense_equivalent"], "model.remat": False})])
      result["ablations"] = rows_of(abl, time_interleaved(abl, rounds, steps, budget)[0])
    except Exception as e:
      result["ablations"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  del kept, abl
  hlos = {}
  if spec.levers:
    result["levers"], hlos = _levers(cfg, spec, best["path"], rows_of, rounds, steps, budget,
                                     dry_run)
  return result, hlo, best, hlos


def _levers(cfg, spec: Shape, path: str, rows_of, rounds: int, steps: int, budget: Budget,
            dry_run: bool):
  """Each lever of `spec` as a pair timed interleaved: `path` and the dense-equivalent under
  the lever's bindings (one pair's states at a time: a Mixtral cut's state is ~37 GB); the
  MoE program's kernel table and HLO. ([rows per lever], {lever: HLO})."""
  import gc
  out, hlos = [], {}
  for name, bindings, moe_only in spec.levers:
    if budget.left() < (40 if dry_run else 75):
      out.append({"lever": name, "bindings": bindings,
                  "skipped": f"budget: {budget.left():.0f} s left"})
      continue
    pair = [(f"{path}, {name}", {**dict(PATHS)[path], **bindings})]
    if not moe_only:
      pair.append((f"dense_equivalent, {name}", {**dict(PATHS)["dense_equivalent"],
                                                 **bindings}))
    built = _programs(cfg, pair)
    timed, states = time_interleaved(built, rounds, steps, budget)
    row = {"lever": name, "bindings": bindings, "rows": rows_of(built, timed)}
    prog = built[0][1]
    if prog is not None:
      hlos[name] = prog.train_step.as_text()
      try:
        prof = _profile(prog, states[built[0][0]])
        prof.pop("state")
        row["profile"] = prof
      except Exception as e:
        row["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out.append(row)
    del built, states, prog
    gc.collect()
  return out, hlos


def train_child(path: str, out: str, budget_s: str, dry_run: str,
                shape: str = "gpu_config", levers_only: str = "0") -> None:
  """One shape's train-step measurement, in its own process: its result, the fastest path's
  row, its scheduled HLO and each lever's go to `path` (JSON)."""
  import jax
  dev = jax.devices()[0]
  peak = next((v for k, v in PEAK_BF16.items() if k in dev.device_kind), None)
  result, hlo, best, lever_hlos = step_train(
      load_config(dry_run == "1", 1, shape), dry_run == "1", Budget(float(budget_s)), out,
      peak, shape, levers_only == "1")
  with open(path, "w") as f:
    json.dump({"result": result, "best": best, "hlo_text": hlo, "lever_hlos": lever_hlos}, f)


