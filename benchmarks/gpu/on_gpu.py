"""The one command to run when a GPU is lent: `python -m benchmarks.gpu.on_gpu --budget_s 540
--out DIR [--dry_run]`.

Steps in priority order, each skipped (with the reason) when the budget left is below its
estimate (the wall time the step took in the newest committed run, or a default), the JSON
rewritten after every step so that a cut-off run still returns what it did:
  1. the GPU's own GpuTargetConfigProto, the target of the compile-only GPU programs;
  2. the rates a schedule estimate needs (`benchmarks.gpu.gpu_rates`: HBM, GEMMs at the trained
     shapes, cuDNN and XLA attention by head dim and sequence);
  3. train-step tokens/s and MFU of the Mixtral- and Qwen3-shaped cuts of
     `gpu_train_step.SHAPES`, through the trainer's own `build_program`, MoE paths and the
     dense-equivalent interleaved, the fastest path's whole kernel profile, then its levers;
  4. the peer: MaxText's MoE layer beside ours (`benchmarks.peer.peer_maxtext`, with the
     wheels carried in `.peer_wheels/`);
  5. the grouped matmul's sweep against the dense dot (`benchmarks.kernels.gpu_gmm_sweep`);
  6. the GPU config's per-GPU expert slice, then the GPU config with every path and its
     ablations;
  7. the kernels' tests on the GPU (pass/fail per test);
  8. the GPU config's train step compiled for 8 and 64 GPUs with `jax_mock_gpu_topology`
     (autotuned), its memory and collectives;
  9. the schedule estimate (moejax.aot) of each measured program beside its measured step.
Files beside the JSON: the scheduled HLO of each shape's fastest path (step_hlos.json.gz)
and their kernel tables (kernel_profiles.json.gz), which the estimate's tests read.
`--dry_run` runs step 3 on CPU at a tiny size (the code path, not the numbers) and reports the
others as skipped. The train-step measurement itself is `benchmarks.gpu.gpu_train_step`.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO, start
from benchmarks.gpu.gpu_train_step import (
  SHAPES,
  Budget,
  load_config,
  train_child,
  with_bindings,
)
from moejax.runtime import xla_flags

# The steps in the order they run (the names --skip takes and the JSON's "steps" keys).
STEPS = ("target_config", "rates", "train_mixtral_2l", "train_qwen3_4l", "peer_maxtext",
         "gmm_sweep", "train_gpu_config_ep8_slice", "train_steps", "kernel_tests",
         "mock_topology", "schedule_estimate")
KERNEL_TESTS = ("tests/test_pallas_kernels.py", "tests/test_moe_kernels.py",
                "tests/test_gpu_config.py")


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


MOCK_STRATEGIES = (("fsep/xla", {"moe.expert_mode": "fsep", "moe.dispatch": "dense",
                                 "moe.kernels": "xla"}),
                   ("ragged/pallas (config)", {}))


def mock_compile(topology: str, name: str) -> dict:
  """In a fresh process: the GPU config's train step compiled for `topology` by
  `moejax.aot` (autotuned on this GPU, train.py's flags) and read like the compile-only ones."""
  import jax
  jax.config.update("jax_mock_gpu_topology", topology)
  from moejax.aot import compile_train_step
  from moejax.aot.summary import summarize
  devices = jax.devices()
  print(f"[mock {topology}] {len(devices)} devices; building {name}", file=sys.stderr,
        flush=True)
  cfg = with_bindings(load_config(False, len(devices)), dict(MOCK_STRATEGIES)[name])
  cfg = with_bindings(cfg, {"mesh.expert": 8, "mesh.data": -1}).validate()
  gp = compile_train_step(cfg, topology=topology, devices=devices)
  print(f"[mock {topology}] compiled in {gp.compile_s:.0f} s", file=sys.stderr, flush=True)
  row = summarize(gp)
  return {**row, "topology": topology, "strategy": name, "devices": len(devices)}


def step_mock(budget: Budget, per_compile_s: float) -> list:
  rows = []
  for topology in ("1x8x1", "8x8x1"):
    for name, _ in MOCK_STRATEGIES:
      if budget.left() < per_compile_s:
        rows.append({"topology": topology, "strategy": name,
                     "skipped": f"budget: {budget.left():.0f} s left, a compile needs "
                                f"~{per_compile_s:.0f} s"})
        continue
      cmd = [sys.executable, "-m", "benchmarks.gpu.on_gpu", "--_mock", topology, name]
      # The child's stderr goes to a file, so that a compile cut off by the timeout still
      # says where it was (its stage lines and XLA's log).
      with tempfile.TemporaryFile("w+") as err:
        try:
          proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                timeout=min(budget.left() - 10, 2 * per_compile_s))
          last = proc.stdout.strip().splitlines()[-1:] or [""]
          row = json.loads(last[0]) if last[0].startswith("{") else {"error": "no result"}
        except subprocess.TimeoutExpired as e:
          row = {"error": f"timed out after {e.timeout:.0f} s"}
        if "error" in row:
          err.seek(0)
          row["stderr_tail"] = err.read()[-1500:]
      rows.append({"topology": topology, "strategy": name, **row})
  return rows


PEER_WHEELS = ".peer_wheels"   # python -m benchmarks.peer.peer_maxtext --print_wheels DIR


def step_peer(out: str, timeout: float) -> dict:
  """MaxText's MoE layer beside ours on this GPU (benchmarks.peer.peer_maxtext), in a process
  of its own with the MaxText wheels carried in `PEER_WHEELS` (the GPU machine has no
  network) installed into a folder of their own."""
  wheels = os.path.join(REPO, PEER_WHEELS)
  if not os.path.isdir(wheels):
    return {"skipped": f"no {PEER_WHEELS}/: run `python -m benchmarks.peer.peer_maxtext "
                       f"--print_wheels {PEER_WHEELS}` where pip reaches PyPI, and carry it"}
  site = tempfile.mkdtemp(prefix="peer_site_")
  install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--no-index", "--no-compile", "--target", site,
                            *sorted(glob.glob(os.path.join(wheels, "*.whl")))],
                           capture_output=True, text=True)
  if install.returncode:
    return {"error": f"installing the MaxText wheels: {install.stderr[-800:]}"}
  path = os.path.join(out, "peer_maxtext_gpu.json")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [site, REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
  env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
  try:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peer.peer_maxtext", "--json", path],
                          capture_output=True, text=True, env=env, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}
  if not os.path.exists(path):
    return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
  with open(path) as f:
    got = json.load(f)
  return {"file": os.path.basename(path), "summary": {
      devices: mesh.get("summary") for devices, mesh in got.get("meshes", {}).items()}}


def step_gmm_sweep(out: str, budget_s: float) -> dict:
  """The grouped matmul's fwd / dx / dw against the dense dot at the trained expert shapes
  (benchmarks.kernels.gpu_gmm_sweep), within `budget_s`."""
  path = os.path.join(out, "gpu_gmm_sweep.json")
  try:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels.gpu_gmm_sweep",
                           "--budget_s", str(int(budget_s)), "--json", path],
                          capture_output=True, text=True, timeout=budget_s + 90)
  except subprocess.TimeoutExpired:
    proc = None
  if not os.path.exists(path):
    return {"error": "timed out" if proc is None else
            f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
  with open(path) as f:
    rows = json.load(f).get("rows", [])
  best = {}
  for r in rows:
    if r.get("ok") and r.get("of_dense") and r["impl"] != "xla_dense":
      key = f"{r.get('shape', '')} {r['pass']}"
      if key not in best or r["of_dense"] > best[key]["of_dense"]:
        best[key] = {"impl": r["impl"], "of_dense": r["of_dense"]}
  return {"file": os.path.basename(path), "rows": len(rows), "best_of_dense": best}


def _last_wall_s() -> dict:
  """Each step's wall seconds in the newest committed on_gpu run (by its date)."""
  import glob
  runs = []
  for name in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     "on_gpu_*.json")):
    with open(name) as f:
      got = json.load(f)
    if not got.get("dry_run"):
      runs.append((got["metadata"].get("date", ""), got["steps"]))
  if not runs:
    return {}
  steps = max(runs, key=lambda r: r[0])[1]
  return {k: v["wall_s"] for k, v in steps.items()
          if isinstance(v, dict) and "wall_s" in v and not v.get("skipped")}


def machine() -> dict:
  import platform

  import jax
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": dev.device_kind, "jax": jax.__version__,
          "python": platform.python_version(), "host_cpus": os.cpu_count(),
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.on_gpu", description=(
      "Run the prepared GPU measurements within a time budget and write one JSON."))
  ap.add_argument("--budget_s", type=float, default=540,
                  help="Seconds the whole run may take; steps that would not fit are skipped.")
  ap.add_argument("--out", default="on_gpu_out", help="Folder for the JSON and its files.")
  ap.add_argument("--dry_run", action="store_true",
                  help="Run what needs no GPU at a tiny size and report the rest as skipped.")
  ap.add_argument("--skip", default="", help=(
      f"Comma-separated steps not to run ({', '.join(STEPS)}), e.g. to finish on a second "
      "call what the first left out."))
  ap.add_argument("--_mock", nargs=2, help=argparse.SUPPRESS)
  ap.add_argument("--levers_only", action="store_true", help=(
      "In each shape's step, time only its levers (gpu_train_step.SHAPES), not its paths."))
  ap.add_argument("--_train", nargs=6, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  skip = {name for name in args.skip.split(",") if name}
  unknown = sorted(skip - set(STEPS))
  if unknown:
    ap.error(f"--skip {','.join(unknown)}: no such step; the steps are {', '.join(STEPS)}")
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
    if fraction := xla_flags.default_memory_fraction(os.environ, platform):
      os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
  # This process reads the device and starts the others; the memory is theirs.
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  import jax
  os.makedirs(args.out, exist_ok=True)
  info = machine()
  on_gpu = info["platform"] == "gpu"
  kind = re.sub(r"[^a-z0-9]+", "_", info["device_kind"].lower()).strip("_") if on_gpu else "cpu"
  from benchmarks.common import metadata
  result = {"benchmark": "on_gpu",
            "metadata": dict(metadata(" ".join(["python -m benchmarks.gpu.on_gpu", *sys.argv[1:]])),
                             detail=info),
            "dry_run": args.dry_run, "budget_s": args.budget_s, "steps": {}}
  path = os.path.join(args.out, f"on_gpu_{kind}.json")
  no_gpu = "no GPU: jax.devices() are " + info["platform"]

  def record(name, fn, estimate_s, needs_gpu=True):
    tick = time.monotonic()
    if name in skip:
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

  last = _last_wall_s()

  def need(step, default_s):
    """The step's wall time in the newest committed run (+20%), else `default_s`."""
    return 1.2 * last[step] if step in last else default_s

  record("target_config", lambda: step_target_config(args.out, kind), 5)

  def rates():
    child = os.path.join(args.out, "rates.tmp.json")
    cmd = [sys.executable, "-m", "benchmarks.gpu.gpu_rates", "--json", child]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=max(min(budget.left() - 5, 240), 10))
    if not os.path.exists(child):
      return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    with open(child) as f:
      got = json.load(f)
    os.remove(child)
    return got
  record("rates", rates, need("rates", 60))
  hlos, profiles, measured = {}, {}, {}

  def train(shape, cap_s):
    # Its own process: the measured steps get the GPU's memory pool to themselves, and the
    # steps after them get it back when it exits.
    child = os.path.join(args.out, f"train_{shape}.tmp.json")
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
    allowed = min(budget.left() - 15, cap_s)
    cmd = [sys.executable, "-m", "benchmarks.gpu.on_gpu", "--_train", child, args.out,
           str(allowed), "1" if not on_gpu else "0", shape, "1" if args.levers_only else "0"]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                            timeout=max(allowed + 60, 10))
    except subprocess.TimeoutExpired as e:
      return {"error": f"timed out after {e.timeout:.0f} s"}
    if not os.path.exists(child):
      return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    with open(child) as f:
      got = json.load(f)
    os.remove(child)
    result = got["result"]
    if got.get("hlo_text"):
      hlos[shape] = got["hlo_text"]
      measured[shape] = got["best"]
    for lever, text in got.get("lever_hlos", {}).items():
      hlos[f"{shape}, {lever}"] = text
    table = (result.get("profile") or {}).pop("table", None)
    if table is not None:
      profiles[shape] = {"path": result.get("best"), **table}
    for lever in result.get("levers", []):
      if lever.get("rows"):
        measured[f"{shape}, {lever['lever']}"] = lever["rows"][0]
      table = (lever.get("profile") or {}).pop("table", None)
      if table is not None:
        profiles[f"{shape}, {lever['lever']}"] = {"path": lever["rows"][0]["path"], **table}
    with gzip.open(os.path.join(args.out, "step_hlos.json.gz"), "wt") as f:
      json.dump(hlos, f)
    with gzip.open(os.path.join(args.out, "kernel_profiles.json.gz"), "wt") as f:
      json.dump(profiles, f)
    return result

  # (shape, the step's name in the JSON, default estimate s, cap s): the shapes people train
  # first, then the peer and the grouped matmul's sweep, then the GPU config's own rows
  # ("train_steps" keeps its earlier name).
  order = (("mixtral_2l", "train_mixtral_2l", 200, 200), ("qwen3_4l", "train_qwen3_4l", 200, 200))
  for shape, step, default_s, cap_s in order:
    assert shape in SHAPES
    record(step, lambda shape=shape, cap_s=cap_s: train(shape, cap_s),
           30 if not on_gpu else need(step, default_s), needs_gpu=False)
  record("peer_maxtext", lambda: step_peer(args.out, min(150, budget.left() - 10)),
         need("peer_maxtext", 90))
  record("gmm_sweep", lambda: step_gmm_sweep(args.out, min(90, budget.left() - 30)),
         need("gmm_sweep", 110))
  for shape, step, default_s, cap_s in (
      ("gpu_config_ep8_slice", "train_gpu_config_ep8_slice", 100, 150),
      ("gpu_config", "train_steps", 150, 300)):
    record(step, lambda shape=shape, cap_s=cap_s: train(shape, cap_s),
           30 if not on_gpu else need(step, default_s), needs_gpu=False)
  # time-boxed so that the mock topology, unless skipped, keeps its minutes
  mock_reserve_s = 0 if "mock_topology" in skip else 100
  record("kernel_tests",
         lambda: step_kernel_tests(args.out, min(100, budget.left() - mock_reserve_s)),
         need("kernel_tests", 100) + mock_reserve_s)
  record("mock_topology", lambda: {"rows": step_mock(budget, 90)}, 90)

  def schedule():
    if not hlos:
      return {"skipped": "no train step was measured"}
    from moejax.aot.estimate import estimate
    from moejax.aot.hlo import parse
    rows = []
    for shape, text in hlos.items():
      est = estimate(parse(text), "h100" if "H100" in info["device_kind"] else "h200", "1x1x1")
      best = measured.get(shape, {"path": None})
      rows.append({"shape": shape, "path": best["path"],
                   "measured_step_s": best.get("step_s_median"), "estimated_step_s": est.step_s,
                   "estimated_compute_s": est.compute_s,
                   "estimated_exposed_comm_s": est.exposed_comm_s,
                   "estimated_by_category": est.by_category})
    return {"hlo": "step_hlos.json.gz", "rows": rows}
  record("schedule_estimate", schedule, 1)
  print(f"wrote {path}")
  del jax
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
