"""MaxText's MoE layer beside ours: the same tokens, router and expert weights through
MaxText's `RoutedMoE` (each path it offers) and through the trainer's own MoE layer, forward
and forward+backward, timed in turns in one process, outputs and gradients compared.

What runs, per mesh (CPU: 8 fake devices, then 1; GPU: one device):
  ours (moejax.model.moe.layer.moe_apply with the options of configs/gpt_moe_gpu.gin: bf16
  compute, fp32 parameters, the config's balance and z losses in the loss):
    moejax/config   the config's own path: moe.dispatch='ragged', moe.kernels='pallas',
                    moe.ragged_buffer_factor=2.0 (dropless unless a device receives more than
                    twice its balanced share; drops are counted and reported).
    moejax/dense    moe.dispatch='dense' at the config's capacity factor: the twin of
                    MaxText's capacity path, with the same drops (below).
    On CPU moe.kernels='xla' (Pallas on CPU is its interpreter, whose time says nothing), and
    jax.lax.ragged_all_to_all, which XLA:CPU lacks, is moejax's all_to_all emulation (as in
    the tests) for both layers. On a GPU both layers run under train.py's XLA flags.
  MaxText (benchmarks.peer.maxtext_layer: its install, config and mesh; expert parallelism over
  the mesh, float32 gate logits, load_balance_loss_weight = our balance weight):
    maxtext/dense_capacity  sparse_matmul=False at our capacity factor: one-hot dispatch and
                            combine einsums, drops past capacity.
    maxtext/dense_dropless  sparse_matmul=False, capacity_factor=-1: every token through every
                            expert (E/k times the expert FLOPs), weighted sum.
    maxtext/ragged_dot      sparse_matmul=True, megablox=False: sort, jax.lax.ragged_dot.
    maxtext/megablox        sparse_matmul=True, megablox=True: its Pallas TPU grouped matmul,
                            interpreted off TPU; run at --tiny or when named in --paths.
    maxtext/tokamax         sparse_matmul=True, use_tokamax_gmm=True: tokamax.ragged_dot
                            ("mosaic": Mosaic GPU on NVIDIA; on CPU it asks for Mosaic TPU and
                            is refused, which the row records).
  Both layers see the tokens as [devices, tokens per device, D], one sequence per device:
  MaxText's capacity is per sequence and ours per (source device, expert), both
  ceil(T*k/E) * factor rows filled in token order, so at equal factors they drop the same
  choices; each row says how many it dropped (MaxText's count from its own generate_masks).

Checks (a MaxText row's "agreement"): against our path of the same drops (dropless against
moejax/config when it dropped nothing, capacity against moejax/dense), on the output y and on
the gradients of the three expert weights (the router's gradient carries each side's own
balance loss, so it is not compared): relative Frobenius error |a - b| / |b| within
TOLERANCES of the compute dtype (`--dtype float32`: the layers agree to about 1e-7).

Timing: every program is compiled first (compile seconds recorded), then `--rounds` rounds,
each running every path's forward once and forward+backward (value_and_grad with respect to
the parameters and the tokens) once, the order rotated per round, so a noisy shared host hits
every path alike; a row reports medians. The summary sets, per mesh and drop class, our
fastest path beside MaxText's fastest at the same drops (ratio = MaxText ms / ours ms, > 1:
ours faster). Without MaxText importable our rows still run and the JSON says why.

Run from the repository root with MaxText's Python (install: benchmarks/maxtext_layer.py):

  python -m benchmarks.peer.peer_maxtext              # CPU: GPU-config shapes, 64 tokens/device
  python -m benchmarks.peer.peer_maxtext --tiny       # the code path in seconds (the test's)
  python -m benchmarks.peer.peer_maxtext --no_peer    # ours only
  # one GPU, about a minute: the GPU config's layer at 8192 tokens per device
  pip install --no-deps --no-index WHEEL_DIR/*.whl && \\
      python -m benchmarks.peer.peer_maxtext --json $OUT/peer_maxtext_gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import REPO, command, start, write_result
from benchmarks.peer import RESULTS, maxtext_layer as peer
from moejax.layout.tables import static_layout
from moejax.model.mesh import BATCH_AXES, logical_to_spec, mesh_of_shape
from moejax.model.moe.layer import EXPERT_PARAM_AXES, ROUTER_AXES, moe_apply
from moejax.runtime import xla_flags

GIN = os.path.join(REPO, "configs", "gpt_moe_gpu.gin")


def platform_flags() -> None:
  """Before JAX starts its backends: on a GPU, train.py's XLA flags (the ragged all-to-all
  decomposed, the latency-hiding scheduler), which both layers then run under; without a GPU,
  the CPU platform (a CUDA plugin installed on a host without a GPU fails JAX's start-up
  otherwise)."""
  if "JAX_PLATFORMS" not in os.environ and not any(
      os.path.exists(n) for n in ("/dev/nvidiactl", "/dev/kfd")):
    os.environ["JAX_PLATFORMS"] = "cpu"
  if xla_flags.platform_before_init(os.environ, xla_flags.installed_jax_plugins()) == "gpu":
    have = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(have + [f for f in xla_flags.GPU_FLAGS if f not in have])
# |a - b| / |b| allowed between the layers, by compute dtype. bf16: 2^-8 relative through
# three matmuls, MaxText's gate weights rounded to bf16; the expert-weight gradients go through
# two more matmuls of rounded operands. float32: summation order only.
TOLERANCES = {"bfloat16": {"y_rel": 3e-2, "grad_rel": 4e-2},
              "float32": {"y_rel": 1e-5, "grad_rel": 1e-5}}


@dataclasses.dataclass(frozen=True)
class Shape:
  what: str
  bindings: tuple[str, ...]   # gin bindings on configs/gpt_moe_gpu.gin
  tokens_gpu: int             # tokens per device on a GPU
  tokens_cpu: int             # ... on CPU fake devices (which share a few cores)


SHAPES = {
    "gpu": Shape("the GPU config's MoE layer: D 768, 32 experts of d_ff 1536, top-2, cf 1.25",
                 (), 8192, 64),
    "mixtral": Shape("a Mixtral-8x7B MoE layer: D 4096, 8 experts of d_ff 14336, top-2",
                     ("model.d_model = 4096", "model.num_heads = 32", "moe.num_experts = 8",
                      "moe.d_ff = 14336"), 4096, 16),
    "tiny": Shape("seconds on CPU: D 64, 8 experts of d_ff 128, top-2",
                  ("model.d_model = 64", "model.num_heads = 4", "moe.num_experts = 8",
                   "moe.d_ff = 128"), 64, 32),
}


def layer_config(shape: Shape, dtype: str = ""):
  """The trainer's Config for configs/gpt_moe_gpu.gin with the shape's bindings (and
  model.dtype = `dtype` when given)."""
  from moejax.frontend import parse_config
  extra = [f"model.dtype = '{dtype}'"] if dtype else []
  return parse_config([GIN], list(shape.bindings) + extra)


def make_data(seed: int, devices: int, tokens: int, d_model: int, cfg_moe, dtype):
  """Host arrays: our parameters (router [D, E], experts [E, D, F] / [E, F, D]; the trainer's
  initialisers, fp32), tokens x [devices, tokens, D] in the compute dtype (the trainer's
  activations) and the loss's cotangent."""
  e, f = cfg_moe.num_experts, cfg_moe.d_ff
  kr, kg, ku, kd, kx, kc = jax.random.split(jax.random.key(seed), 6)
  normal = lambda k, shape, std: np.asarray(std * jax.random.normal(k, shape, jnp.float32))
  params = {"router": normal(kr, (d_model, e), 0.02),
            "w_gate": normal(kg, (e, d_model, f), d_model ** -0.5),
            "w_up": normal(ku, (e, d_model, f), d_model ** -0.5),
            "w_down": normal(kd, (e, f, d_model), f ** -0.5)}
  x = np.asarray(jax.random.normal(kx, (devices, tokens, d_model), dtype))
  ct = normal(kc, (devices, tokens, d_model), 1.0 / (devices * tokens))
  return params, x, ct


def our_paths(cfg, mesh, params_h, x_h, ct_h, on_cpu: bool) -> list[peer.Path]:
  """moejax/config and moejax/dense on `mesh`, compiled."""
  moe_cfg, dtype = cfg.moe, jnp.dtype(cfg.model.dtype)
  kernels = "xla" if on_cpu else moe_cfg.kernels
  variants = [("moejax/config", "dropless", dataclasses.replace(moe_cfg, kernels=kernels)),
              ("moejax/dense", "capacity",
               dataclasses.replace(moe_cfg, kernels=kernels, dispatch="dense"))]
  specs = {k: logical_to_spec(v) for k, v in EXPERT_PARAM_AXES.items()}
  specs["router"] = logical_to_spec(ROUTER_AXES)
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params_h.items()}
  x = jax.device_put(x_h, NamedSharding(mesh, P(BATCH_AXES)))
  ct = jax.device_put(ct_h, NamedSharding(mesh, P(BATCH_AXES)))
  layout = jax.device_put(
      jax.tree.map(lambda a: a[0], static_layout(1, moe_cfg.num_experts, mesh.shape["expert"])),
      NamedSharding(mesh, P()))
  paths = []
  for name, drops, c in variants:
    def fwd(params, x, layout, c=c):
      y, stats = moe_apply(params, x, layout, c, mesh, dtype)
      aux = c.balance_loss_weight * stats.balance_loss + c.z_loss_weight * stats.z_loss
      return y, aux, jnp.sum(stats.dropped_W)

    def loss(params, x, layout, ct, fwd=fwd):
      y, aux, dropped = fwd(params, x, layout)
      return jnp.sum(y.astype(jnp.float32) * ct) + aux, (y, dropped)

    options = {"dispatch": c.dispatch, "kernels": c.kernels,
               "capacity_factor": c.capacity_factor,
               "ragged_buffer_factor": c.ragged_buffer_factor, "dtype": str(dtype)}
    path = peer.Path(name, "moejax", drops, options, args=(params, x, layout, ct))
    try:
      with peer.emulated_collective(on_cpu):
        t0 = time.perf_counter()
        path.fwd = jax.jit(fwd).lower(params, x, layout).compile()
        path.fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)).lower(
            params, x, layout, ct).compile()
      path.extra["compile_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001  (recorded in the row)
      path.error = peer.one_line(e)
    paths.append(path)
  return paths


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def warm(path: peer.Path) -> dict:
  """One forward and one forward+backward: the output, expert gradients and drop count."""
  (_, (y, dropped)), grads = jax.block_until_ready(path.fwd_bwd(*path.args))
  jax.block_until_ready(path.fwd(*path.args[:-1]))
  if path.side == "moejax":
    g, dropped = {k: grads[0][k] for k in ("w_gate", "w_up", "w_down")}, int(dropped)
  else:
    g, dropped = peer.expert_grads(grads), path.extra.get("dropped", 0)
  return {"y": np.asarray(y, np.float32), "grads": {k: np.asarray(v) for k, v in g.items()},
          "dropped": dropped}


def time_rounds(paths: list[peer.Path], rounds: int) -> dict:
  """Per path, the seconds of each round's forward and forward+backward call."""
  ran = [p for p in paths if p.error is None]
  times = {p.name: {"fwd": [], "fwd_bwd": []} for p in ran}
  for r in range(rounds):
    shift = r % max(len(ran), 1)
    for p in ran[shift:] + ran[:shift]:
      t0 = time.perf_counter()
      jax.block_until_ready(p.fwd(*p.args[:-1]))
      times[p.name]["fwd"].append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      jax.block_until_ready(p.fwd_bwd(*p.args))
      times[p.name]["fwd_bwd"].append(time.perf_counter() - t0)
  return times


def compare(ours: dict, other: dict, tol: dict) -> dict:
  y = rel_err(other["y"], ours["y"])
  grads = {k: rel_err(other["grads"][k], ours["grads"][k]) for k in ours["grads"]}
  return {"y_rel": y, "grad_rel": grads,
          "ok": bool(y <= tol["y_rel"] and max(grads.values()) <= tol["grad_rel"])}


def run_mesh(args, cfg, mt, devices: int, tokens: int, platform: str, out_dir: str) -> dict:
  """Every path on a mesh of `devices`: rows (timings, drops, agreement) and the summary."""
  params_h, x_h, ct_h = make_data(args.seed, devices, tokens, cfg.model.d_model, cfg.moe,
                                  jnp.dtype(cfg.model.dtype))
  paths = our_paths(cfg, mesh_of_shape((1, devices, 1)), params_h, x_h, ct_h, platform == "cpu")
  if mt is not None:
    names = args.paths or list(peer.PEER_PATHS)
    skip = {} if args.paths or args.shape == "tiny" else peer.INTERPRETED
    paths += peer.maxtext_paths(mt, cfg, devices, params_h, x_h, ct_h, platform, names, skip,
                                out_dir)
  outs = {}
  for p in paths:
    if p.error is None:
      try:
        outs[p.name] = warm(p)
      except Exception as e:  # noqa: BLE001  (recorded in the row)
        p.error = peer.one_line(e)
  times = time_rounds(paths, args.rounds)
  choices = devices * tokens * cfg.moe.top_k
  twin = {"dropless": "moejax/config", "capacity": "moejax/dense"}
  rows = []
  for p in paths:
    row = {"devices": devices, "path": p.name, "side": p.side, "drops": p.drops,
           "options": p.options}
    rows.append(row)
    if p.error is not None:
      row["error"] = p.error
      continue
    t, out = times[p.name], outs[p.name]
    fwd_ms, fb_ms = 1e3 * statistics.median(t["fwd"]), 1e3 * statistics.median(t["fwd_bwd"])
    row.update({"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms,
                "fwd_bwd_tokens_per_s": devices * tokens / (fb_ms / 1e3),
                "dropped": out["dropped"], "dropped_fraction": out["dropped"] / choices,
                "compile_s": p.extra.get("compile_s"),
                "fwd_ms_all": [1e3 * s for s in t["fwd"]],
                "fwd_bwd_ms_all": [1e3 * s for s in t["fwd_bwd"]]})
    ref = twin[p.drops]
    if p.side == "maxtext" and ref in outs:
      if outs[ref]["dropped"] == out["dropped"]:
        row["agreement"] = {"vs": ref, **compare(outs[ref], out, TOLERANCES[cfg.model.dtype])}
      else:
        row["agreement"] = {"vs": ref, "ok": None,
                            "why": f"not compared: {ref} dropped {outs[ref]['dropped']} "
                                   f"choices, this path {out['dropped']}"}
  return {"rows": rows, "summary": summarise(rows)}


def summarise(rows: list[dict]) -> list[dict]:
  """Per drop class, our fastest path beside MaxText's fastest at the same drops (fwd+bwd)."""
  out = []
  for drops in ("dropless", "capacity"):
    ran = [r for r in rows if r["drops"] == drops and "fwd_bwd_ms" in r]
    ours = [r for r in ran if r["side"] == "moejax"]
    if not ours:
      continue
    best = min(ours, key=lambda r: r["fwd_bwd_ms"])
    entry = {"drops": drops, "ours": best["path"], "ours_fwd_bwd_ms": best["fwd_bwd_ms"],
             "ours_fwd_ms": best["fwd_ms"], "ours_dropped": best["dropped"], "maxtext": None}
    same = [r for r in ran if r["side"] == "maxtext" and r["dropped"] == best["dropped"]]
    if same:
      fast = min(same, key=lambda r: r["fwd_bwd_ms"])
      entry.update({"maxtext": fast["path"], "maxtext_fwd_bwd_ms": fast["fwd_bwd_ms"],
                    "maxtext_fwd_ms": fast["fwd_ms"],
                    "fwd_bwd_ratio": fast["fwd_bwd_ms"] / best["fwd_bwd_ms"],
                    "fwd_ratio": fast["fwd_ms"] / best["fwd_ms"],
                    "ours_ahead": best["fwd_bwd_ms"] < fast["fwd_bwd_ms"],
                    # A faster path whose output or gradients disagree with ours beyond the
                    # tolerance computed something else: the row says so.
                    "maxtext_agrees": fast.get("agreement", {}).get("ok")})
    out.append(entry)
  return out


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.peer.peer_maxtext",
                               description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="gpu",
                  help="The layer's shape (SHAPES; default: the GPU config's).")
  ap.add_argument("--tokens", type=int, default=0,
                  help="Tokens per device (0: the shape's for this platform).")
  ap.add_argument("--devices", default="",
                  help="Comma-separated mesh sizes (default: 8,1 on CPU, 1 on a GPU).")
  ap.add_argument("--rounds", type=int, default=5, help="Timed rounds; rows give medians.")
  ap.add_argument("--paths", default="",
                  help="Comma-separated MaxText paths (default: all but the interpreted).")
  ap.add_argument("--tiny", action="store_true",
                  help="Shorthand for --shape tiny with at most 2 rounds.")
  ap.add_argument("--no_peer", action="store_true", help="Run our rows only.")
  ap.add_argument("--dtype", choices=sorted(TOLERANCES), default="",
                  help="Compute dtype of both layers (default: the config's, bfloat16).")
  ap.add_argument("--seed", type=int, default=0, help="Seed of weights and tokens.")
  ap.add_argument("--json", default="",
                  help="Output JSON (default: benchmarks/peer/results/peer_maxtext_cpu.json, or "
                       "_gpu.json on a GPU).")
  ap.add_argument("--print_wheels", metavar="DIR", default="",
                  help="Print the pip commands that fetch MaxText's wheels into DIR and "
                       "install them, and exit.")
  args = ap.parse_args(argv)
  if args.tiny:
    args.shape, args.rounds = "tiny", min(args.rounds, 2)
  args.paths = [p for p in args.paths.split(",") if p]
  unknown = sorted(set(args.paths) - set(peer.PEER_PATHS))
  if unknown:
    ap.error(f"--paths {','.join(unknown)}: no such MaxText path; use some of "
             f"{','.join(peer.PEER_PATHS)}.")
  if args.rounds < 1:
    ap.error(f"--rounds {args.rounds} must be >= 1.")
  return args


def main(argv=None) -> dict | None:
  args = parse_args(argv)
  start = time.perf_counter()
  if args.print_wheels:
    print(peer.download_command(args.print_wheels))
    print(peer.install_command(args.print_wheels))
    return None
  platform = jax.devices()[0].platform
  shape = SHAPES[args.shape]
  tokens = args.tokens or (shape.tokens_cpu if platform == "cpu" else shape.tokens_gpu)
  sizes = [int(d) for d in (args.devices or ("8,1" if platform == "cpu" else "1")).split(",")]
  if max(sizes) > jax.device_count():
    raise SystemExit(f"--devices {max(sizes)} > the {jax.device_count()} devices here; "
                     f"use at most {jax.device_count()}.")
  cfg = layer_config(shape, args.dtype)
  mt, why = (None, "not asked for (--no_peer)") if args.no_peer else peer.import_peer()
  if mt is None:
    print(f"MaxText rows left out: {why}")
  result = {
      "benchmark": "peer_maxtext: MaxText's RoutedMoE paths beside moejax's MoE layer",
      "command": command("peer.peer_maxtext", argv),
      "shape": {"name": args.shape, "what": shape.what, "d_model": cfg.model.d_model,
                "num_experts": cfg.moe.num_experts, "d_ff": cfg.moe.d_ff,
                "top_k": cfg.moe.top_k, "capacity_factor": cfg.moe.capacity_factor,
                "tokens_per_device": tokens, "dtype": cfg.model.dtype,
                "gin": "configs/" + os.path.basename(GIN)},
      "peer": {"maxtext": None if mt is None else peer.MAXTEXT_VERSION, "why_absent": why},
      "rounds": args.rounds, "tolerances": TOLERANCES[cfg.model.dtype], "meshes": {}}
  with tempfile.TemporaryDirectory() as out_dir:
    for devices in sizes:
      mesh = run_mesh(args, cfg, mt, devices, tokens, platform, out_dir)
      result["meshes"][str(devices)] = mesh
      print_mesh(devices, mesh)
  result["wall_s"] = time.perf_counter() - start   # what a GPU run's budget must allow
  write_result(result, args.json or os.path.join(RESULTS, f"peer_maxtext_{platform}.json"))
  return result


def print_mesh(devices: int, mesh: dict) -> None:
  print(f"\n{devices} device(s): median ms of interleaved rounds")
  print(f"{'path':<24} {'fwd':>9} {'fwd+bwd':>9} {'dropped':>8} {'y_rel':>8} {'grad_rel':>8}")
  for r in mesh["rows"]:
    if "error" in r:
      print(f"{r['path']:<24} {r['error'][:100]}")
      continue
    a = r.get("agreement", {})
    g = max(a["grad_rel"].values()) if "grad_rel" in a else math.nan
    print(f"{r['path']:<24} {r['fwd_ms']:9.2f} {r['fwd_bwd_ms']:9.2f} "
          f"{r['dropped_fraction']:8.2%} {a.get('y_rel', math.nan):8.1e} {g:8.1e}")
  for s in mesh["summary"]:
    if s["maxtext"]:
      print(f"{s['drops']}: {s['ours']} {s['ours_fwd_bwd_ms']:.2f} ms vs {s['maxtext']} "
            f"{s['maxtext_fwd_bwd_ms']:.2f} ms fwd+bwd (MaxText/ours {s['fwd_bwd_ratio']:.2f})")


if __name__ == "__main__":
  start()
  platform_flags()   # on a GPU, adds train.py's flags to start()'s (host devices only)
  main()
