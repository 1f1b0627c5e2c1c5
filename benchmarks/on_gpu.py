"""The one command to run when a GPU is lent: `python -m benchmarks.on_gpu --budget_s 540
--out DIR [--dry_run]`.

Steps in priority order, each skipped (with the reason) when the budget left is below its
estimate, the JSON rewritten after every step so that a cut-off run still returns what it did:
  1. the GPU's own GpuTargetConfigProto, the target of the compile-only GPU programs;
  2. the kernels' tests on the GPU (pass/fail per test);
  3. train-step tokens/s and MFU of the GPU config at the per-GPU batch of an 8-GPU node,
     through the trainer's own `build_program`, its paths interleaved, and a kernel profile of
     the fastest;
  4. the same train step compiled for 8 and 64 GPUs with `jax_mock_gpu_topology` (autotuned),
     its memory and collectives;
  5. the one-GPU program's scheduled HLO beside its measured step time, for the schedule
     estimate to be checked offline.
`--dry_run` runs steps 3 and 5 on CPU at a tiny size (the code path, not the numbers) and
reports the others as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
import time

from moejax.runtime import xla_flags

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
KERNEL_TESTS = ("tests/test_pallas_kernels.py", "tests/test_moe_kernels.py",
                "tests/test_gpu_config.py")


def _with(cfg, bindings: dict):
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
  cfg = _with(cfg, {"mesh.data": -1, "mesh.expert": min(devices, cfg.mesh.expert),
                    "mesh.host_device_count": 1,
                    "data.global_batch_size": PER_GPU_BATCH * devices, "data.path": None,
                    "checkpoint.every": 10**9, "train.tensorboard": False})
  if dry_run:
    cfg = _with(cfg, {"model.vocab_size": 512, "model.d_model": 32, "model.num_heads": 4,
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


def step_target_config(out: str, kind: str) -> dict:
  import jax
  from jax._src.lib import xla_client
  text = str(xla_client.get_topology_for_devices(jax.devices()[:1]).target_config)
  path = os.path.join(out, f"target_config_{kind}.txtpb")
  with open(path, "w") as f:
    f.write(text)
  return {"file": os.path.basename(path), "chars": len(text)}


def step_kernel_tests(out: str, timeout: float) -> dict:
  log = os.path.join(out, "kernel_tests.txt")
  cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m",
         "slow or not slow", *KERNEL_TESTS]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    text, rc = proc.stdout + proc.stderr, proc.returncode
  except subprocess.TimeoutExpired as e:
    text, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), None
  with open(log, "w") as f:
    f.write(text)
  outcome = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)", text, re.M)
  counts = {}
  for result, _ in outcome:
    counts[result.lower()] = counts.get(result.lower(), 0) + 1
  return {"returncode": rc, "counts": counts, "log": os.path.basename(log),
          "failed": [name for result, name in outcome if result in ("FAILED", "ERROR")],
          "timed_out": rc is None}


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
      cfg = _with(base, bindings).validate()
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


def _profile(prog, state, out: str, steps: int = 3, top: int = 25) -> dict:
  """GPU kernel time by kernel name over `steps` traced steps (the profiler's trace.json)."""
  import tempfile

  import jax
  logdir = tempfile.mkdtemp(prefix="on_gpu_trace_")
  batch = _batch(prog, 1)
  with jax.profiler.trace(logdir):
    for _ in range(steps):
      state, _ = prog.train_step(state, batch, prog.layout)
    jax.block_until_ready(state)
  traces = [os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs
            if f.endswith(".trace.json.gz")]
  if not traces:
    return {"state": state, "error": f"no trace.json.gz under {logdir}"}
  with gzip.open(traces[0]) as f:
    events = json.load(f).get("traceEvents", [])
  names = {e["pid"]: e["args"].get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
  by_kernel, total = {}, 0.0
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e:
      by_kernel[e["name"]] = by_kernel.get(e["name"], 0.0) + e["dur"]
      total += e["dur"]
  ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
  return {"state": state, "steps": steps, "gpu_processes": sorted(names[p] for p in gpu),
          "gpu_busy_us_per_step": total / steps,
          "top_kernels_us_per_step": [[n[:120], round(us / steps, 1)] for n, us in ranked]}


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
      result["profile"] = _profile(kept[1], kept[2], out)
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


MOCK_STRATEGIES = (("fsep/xla", {"moe.expert_mode": "fsep", "moe.dispatch": "dense",
                                 "moe.kernels": "xla"}),
                   ("ragged/pallas (config)", {}))


def mock_compile(topology: str, name: str) -> dict:
  """In a fresh process: compile the GPU config's train step for `topology` (autotuned on
  this GPU) and read XLA's memory analysis and the collectives of its scheduled HLO."""
  import jax
  jax.config.update("jax_mock_gpu_topology", topology)
  from moejax.strategy.spec import from_config
  from moejax.train import optim
  from moejax.train.programs import build_program, xla_memory
  devices = jax.devices()
  cfg = _with(load_config(False, len(devices)), dict(MOCK_STRATEGIES)[name])
  cfg = _with(cfg, {"mesh.expert": 8, "mesh.data": -1}).validate()
  tx = optim.optimizer(cfg.optim, cfg.train.num_steps)
  real_put = jax.device_put

  def put(x, device=None, **kw):   # one process of the mocked ones holds no global data
    if device is not None and not getattr(device, "is_fully_addressable", True):
      return x                     # the lowering needs only its shapes
    return real_put(x, device, **kw)

  jax.device_put = put
  tick = time.perf_counter()
  prog = build_program(cfg, from_config(cfg, len(devices)), tx,
                       optim.schedule(cfg.optim, cfg.train.num_steps), devices,
                       compile_now=False)
  batch = jax.ShapeDtypeStruct((cfg.data.global_batch_size, cfg.data.seq_len + 1), "int32",
                               sharding=prog.batch_sharding)
  prog.train_step = prog.train_step.lower(prog.abstract_state(tx), batch,
                                          prog.abstract_layout()).compile()
  text = prog.train_step.as_text()
  return {"topology": topology, "strategy": name, "devices": len(devices),
          "compile_s": time.perf_counter() - tick, "memory": xla_memory(prog.train_step),
          "collectives": hlo_collectives(text),
          "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))}


_COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-to-all|ragged-all-to-all|all-reduce|all-gather|"
                         r"reduce-scatter|collective-permute)(-start)?\(")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
                "pred": 1, "s64": 8, "f64": 8}


def hlo_collectives(text: str) -> dict:
  """{kind: {count, bytes, async}} of a scheduled HLO text (bytes: the result shapes)."""
  out = {}
  for shape, kind, start in _COLLECTIVE.findall(text):
    size = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * _DTYPE_BYTES.get(dtype, 4)
    row = out.setdefault(kind, {"count": 0, "bytes": 0, "async": 0})
    row["count"] += 1
    row["bytes"] += size
    row["async"] += bool(start)
  return out


def step_mock(budget: Budget, per_compile_s: float) -> list:
  rows = []
  for topology in ("1x8x1", "8x8x1"):
    for name, _ in MOCK_STRATEGIES:
      if budget.left() < per_compile_s:
        rows.append({"topology": topology, "strategy": name,
                     "skipped": f"budget: {budget.left():.0f} s left, a compile needs "
                                f"~{per_compile_s:.0f} s"})
        continue
      cmd = [sys.executable, "-m", "benchmarks.on_gpu", "--_mock", topology, name]
      try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=min(budget.left() - 10, 2 * per_compile_s))
        last = proc.stdout.strip().splitlines()[-1:] or [""]
        rows.append(json.loads(last[0]) if last[0].startswith("{") else
                    {"topology": topology, "strategy": name, "error": proc.stderr[-1500:]})
      except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rows.append({"topology": topology, "strategy": name,
                     "error": f"timed out after {e.timeout:.0f} s", "stderr_tail": err[-1500:]})
  return rows


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


def machine() -> dict:
  import platform

  import jax
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": dev.device_kind, "jax": jax.__version__,
          "python": platform.python_version(), "host_cpus": os.cpu_count(),
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.on_gpu", description=(
      "Run the prepared GPU measurements within a time budget and write one JSON."))
  ap.add_argument("--budget_s", type=float, default=540,
                  help="Seconds the whole run may take; steps that would not fit are skipped.")
  ap.add_argument("--out", default="on_gpu_out", help="Folder for the JSON and its files.")
  ap.add_argument("--dry_run", action="store_true",
                  help="Run what needs no GPU at a tiny size and report the rest as skipped.")
  ap.add_argument("--skip", default="", help=(
      "Comma-separated steps not to run (target_config, kernel_tests, train_steps, "
      "mock_topology, schedule_estimate), e.g. to redo only a step that failed."))
  ap.add_argument("--_mock", nargs=2, help=argparse.SUPPRESS)
  ap.add_argument("--_train", nargs=4, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args._mock:
    print(json.dumps(mock_compile(*args._mock)))
    return 0
  if args._train:
    train_child(*args._train)
    return 0
  budget = Budget(args.budget_s)
  platform = xla_flags.platform_before_init(os.environ, xla_flags.installed_jax_plugins())
  if platform == "gpu":   # train.py's GPU flags, also beside flags the machine already sets
    have = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(have + [f for f in xla_flags.GPU_FLAGS if f not in have])
  # This process reads the device and starts the others; the memory is theirs.
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  import jax
  os.makedirs(args.out, exist_ok=True)
  info = machine()
  on_gpu = info["platform"] == "gpu"
  kind = re.sub(r"[^a-z0-9]+", "_", info["device_kind"].lower()).strip("_") if on_gpu else "cpu"
  from benchmarks.common import metadata
  result = {"benchmark": "on_gpu",
            "metadata": dict(metadata(" ".join(["python -m benchmarks.on_gpu", *sys.argv[1:]])),
                             detail=info),
            "dry_run": args.dry_run, "budget_s": args.budget_s, "steps": {}}
  path = os.path.join(args.out, f"on_gpu_{kind}.json")
  no_gpu = "no GPU: jax.devices() are " + info["platform"]

  def record(name, fn, estimate_s, needs_gpu=True):
    tick = time.monotonic()
    if name in args.skip.split(","):
      result["steps"][name] = {"skipped": "--skip"}
    elif needs_gpu and not on_gpu:
      result["steps"][name] = {"skipped": no_gpu}
    elif budget.left() < estimate_s:
      result["steps"][name] = {"skipped": f"budget: {budget.left():.0f} s left, step needs "
                                          f"~{estimate_s:.0f} s"}
    else:
      try:
        result["steps"][name] = fn()
      except Exception as e:
        result["steps"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    result["steps"][name]["wall_s"] = round(time.monotonic() - tick, 1)
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
    print(f"[on_gpu] {name}: {json.dumps(result['steps'][name])[:300]}", flush=True)

  record("target_config", lambda: step_target_config(args.out, kind), 5)
  # time-boxed so that the train steps, the most valuable numbers, keep ~5 minutes
  record("kernel_tests", lambda: step_kernel_tests(args.out, min(100, budget.left() - 300)), 330)
  trained = {}

  def train():
    # Its own process: the measured steps get the GPU's memory pool to themselves, and the
    # compiles after them get it back when it exits.
    child = os.path.join(args.out, "train_steps.tmp.json")
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
    cmd = [sys.executable, "-m", "benchmarks.on_gpu", "--_train", child, args.out,
           str(budget.left() - 15), "1" if not on_gpu else "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=max(budget.left() - 5, 10))
    if not os.path.exists(child):
      return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    with open(child) as f:
      trained.update(json.load(f))
    os.remove(child)
    return trained["result"]
  record("train_steps", train, 30 if not on_gpu else 150, needs_gpu=False)
  record("mock_topology", lambda: {"rows": step_mock(budget, 90)}, 90)

  def schedule():
    best = trained.get("best")
    if not best:
      return {"skipped": "no train step was measured"}
    return {"path": best["path"], "hlo": trained["hlo"],
            "measured_step_s": best.get("step_s_median"),
            "estimate": "computed offline from the HLO (python -m benchmarks.gpu_program)"}
  record("schedule_estimate", schedule, 1, needs_gpu=False)
  print(f"wrote {path}")
  del jax
  return 0


if __name__ == "__main__":
  sys.exit(main())
