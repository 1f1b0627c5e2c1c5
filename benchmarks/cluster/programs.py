"""The study's programs: the trainer's train step of a model at one policy's buffer, compiled
by XLA:GPU for compile-only H100s (`moejax.aot.compile_train_step`, the GPU flags train.py
sets), read once into a row (schedule estimate by category and collective, XLA's memory, the
grouped matmul's share) and kept in a cache, so that a program is compiled once per distinct
buffer and reused by every routing that needs that buffer.

A program is (model, topology, kind, factor): kind 'ep' (static and SmartMoE: one program,
the layout is an argument), 'fsep_planned', 'fsep_adaptive' (moe.fsep_shares = 'adaptive'),
or 'ragged' (dropless: factor is moe.ragged_buffer_factor). Dense kinds run pooled capacity
with the grouped-matmul kernels (moe.kernels = 'pallas'): every (source, device) buffer of
`factor` x the balanced share goes through the exchange whole, and the grouped kernel
computes the rows its group sizes hold, so `busiest_step` scales the grouped matmul's time
by the busiest device's rows over the buffer's, the rest of the program as compiled. Each
dense kind has an `_einsum` twin (`ep_einsum`, ...): per-(source, slot) buffers through XLA's
batched einsum, which computes every buffer row, so `busiest_step` leaves it as compiled.
Where the model's config keeps the MoE exchanges for its rematerialised backward, each dense
kind has a `_recomputed` twin too (`ep_recomputed`, `ep_einsum_recomputed`, ...), which runs
them again instead: the kept buffers grow with the factor, and past the GPU's memory (or past
XLA's memory limit, where its scheduler overlaps less) the twin is the program to run.

Where the full depth takes too long to compile, `at_depth` compiles a program at two cut
depths and extrapolates its row to the model's (`extrapolate`: the layers are one scanned
loop; `benchmarks.cluster.layers` checks it against programs compiled at full depth).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time

from benchmarks.common import REPO
from moejax.aot import work
from moejax.aot.estimate import Rates, estimate, kernel
from moejax.aot.gpus import gpu as gpu_info
from moejax.aot.hlo import parse
from moejax.config import Config
from moejax.frontend import parse_config
from moejax.runtime.xla_flags import GPU_MEMORY_FRACTION

MODELS = {"mixtral_8x7b": os.path.join(REPO, "configs", "mixtral_8x7b.gin"),
          "qwen3_30b_a3b": os.path.join(REPO, "configs", "qwen3_moe.gin")}
SEQUENCES_PER_GPU = 4          # Megatron-Core's Mixtral-8x7B run: 256 x 4096 on 64 H100s
KIND_OF_POLICY = {"static": "ep", "smartmoe": "ep", "fsep_planned": "fsep_planned",
                  "fsep_adaptive": "fsep_adaptive", "ragged": "ragged"}
# A dense policy's two programs: pooled (source, device) buffers through the grouped-matmul
# kernel, which computes the rows the groups hold; or per-(source, slot) buffers through XLA's
# batched einsum (a cuBLAS GEMM per slot over the whole buffer), at the dense dot's rate.
KERNELS = ("grouped", "einsum")


def kind_of(policy: str, kernels: str = "grouped", recomputed: bool = False) -> str:
  """The program kind of `policy` on `kernels` (ragged runs the grouped kernel only), its
  `RECOMPUTED` twin with `recomputed`."""
  kind = KIND_OF_POLICY[policy]
  kind = kind if kernels == "grouped" else f"{kind}_einsum"
  return kind + RECOMPUTED if recomputed else kind


def kernels_of(policy: str, kernels: tuple[str, ...]) -> tuple[str, ...]:
  return ("grouped",) if policy == "ragged" else kernels


def gpus(topology: str) -> int:
  return math.prod(int(v) for v in topology.split("x"))


def expert_axis(cfg: Config, n_gpus: int) -> int:
  """The study's expert axis: one node's 8 GPUs for a model of at most 8 experts (its
  config's, Megatron-Core's EP8), else as many GPUs as there are experts, up to all."""
  e = cfg.moe.num_experts
  return min(e, n_gpus) if e > 8 else min(cfg.mesh.expert, n_gpus)


@dataclasses.dataclass(frozen=True)
class Spec:
  model: str
  topology: str
  kind: str
  factor: float
  layers: int = 0              # 0: the model's own depth
  fsdp: bool = False

  def key(self) -> str:
    text = json.dumps(dataclasses.asdict(self), sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def bindings(model: str, topology: str, layers: int = 0, fsdp: bool = False) -> list[str]:
  """The model's config at `topology`: 4 sequences a GPU, the study's expert axis, pooled
  grouped-kernel experts; `layers` (0: the model's) and FSDP over the data axis."""
  n = gpus(topology)
  base = parse_config([MODELS[model]], ["data.path = None"])
  return ["data.path = None", f"data.global_batch_size = {SEQUENCES_PER_GPU * n}",
          "mesh.data = -1", f"mesh.expert = {expert_axis(base, n)}", "moe.kernels = 'pallas'",
          "moe.capacity = 'device'", f"mesh.fsdp = {fsdp}",
          *([f"model.num_layers = {layers}"] if layers else [])]


_GROUPED_KINDS = {
    "ep": ["moe.dispatch = 'dense'"],
    "fsep_planned": ["moe.dispatch = 'dense'", "moe.expert_mode = 'fsep'"],
    "fsep_adaptive": ["moe.dispatch = 'dense'", "moe.expert_mode = 'fsep'",
                      "moe.fsep_shares = 'adaptive'"],
    "ragged": ["moe.dispatch = 'ragged'"],
}
EINSUM = ["moe.kernels = 'xla'", "moe.capacity = 'slot'"]
_DENSE_KINDS = {**_GROUPED_KINDS, **{f"{k}_einsum": [*v, *EINSUM]
                                     for k, v in _GROUPED_KINDS.items() if k != "ragged"}}
# Each dense kind's twin that runs the MoE exchange again in its rematerialised backward, for a
# model whose config keeps it (`model.remat_keeps_exchange`, Mixtral's gin).
RECOMPUTED = "_recomputed"
KIND_BINDINGS = {**_DENSE_KINDS,
                 **{f"{k}{RECOMPUTED}": [*v, "model.remat_keeps_exchange = False"]
                    for k, v in _DENSE_KINDS.items() if k != "ragged"}}
KINDS = tuple(KIND_BINDINGS)


def keeps_exchange(cfg: Config, fsep: bool = False) -> bool:
  """Whether a run of `cfg` keeps its MoE exchanges for the backward: under remat, or for
  an fsep layer (`fsep`), which recomputes in its own backward with remat or without."""
  return cfg.model.remat_keeps_exchange and (cfg.model.remat or fsep)


def run_config(spec: Spec) -> Config:
  """The config a run of `spec`'s model at its topology starts from: the study's bindings,
  the model's own capacity factor (its gin's, else the trainer's default), which the
  planners are told."""
  return parse_config([MODELS[spec.model]], bindings(spec.model, spec.topology, spec.layers,
                                                     spec.fsdp))


def config(spec: Spec) -> Config:
  factor = (f"moe.ragged_buffer_factor = {spec.factor!r}" if spec.kind == "ragged" else
            f"moe.capacity_factor = {spec.factor!r}")
  return parse_config([MODELS[spec.model]], [
      *bindings(spec.model, spec.topology, spec.layers, spec.fsdp), *KIND_BINDINGS[spec.kind],
      factor])


def grouped_matmul(module, rates: Rates) -> dict:
  """The grouped-matmul calls of a program: their seconds per step (each call's estimate
  times how often its computation runs) and the largest row count M they take (the buffer)."""
  runs = module.runs()
  seconds, rows = 0.0, 0
  for comp, times in runs.items():
    shapes = module.by_name(comp)
    for ins in module.computations[comp]:
      if ins.opcode == "custom-call" and work.grouped_matmul_flops(ins, shapes) > 0:
        seconds += times * kernel(module, ins, shapes, rates).seconds
        dims = [shapes[o].arrays()[0][1] for o in ins.operands
                if o in shapes and shapes[o].arrays()]
        rows = max([rows] + [d[0] for d in dims if len(d) == 2])
  return {"seconds": seconds, "rows": rows}


def compile_row(spec: Spec, gpu: str = "h100", hlo_dir: str | None = None) -> dict:
  """Compiles `spec`'s program and reads it into a row (or the one-line error)."""
  from moejax.aot import compile_train_step

  tick = time.perf_counter()
  row = {"spec": dataclasses.asdict(spec), "gpu": gpu}
  try:
    gp = compile_train_step(config(spec), gpu=gpu, topology=spec.topology)
  except Exception as e:   # noqa: BLE001  (a program that does not compile is a result)
    row.update(compiled=False, error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
               [:300], wall_s=round(time.perf_counter() - tick, 1))
    return row
  module = parse(gp.hlo)
  est = estimate(module, gpu, spec.topology)
  peak = gp.memory["argument"] + gp.memory["temp"] + gp.memory["output"] - gp.memory["alias"]
  row.update(
      compiled=True, strategy=gp.program.cfg and _spec_text(gp), attention=gp.attention,
      lower_s=round(gp.lower_s, 1), compile_s=round(gp.compile_s, 1),
      step_s=est.step_s, compute_s=est.compute_s, comm_s=est.comm_s,
      exposed_comm_s=est.exposed_comm_s, by_category=est.by_category, comm_by=est.comm_by,
      exposed_by=est.exposed_by, compute_by=est.compute_by,
      grouped_matmul=grouped_matmul(module, Rates.for_gpu(gpu, spec.topology)),
      peak_bytes=peak, fits=fits(peak, gpu),
      wall_s=round(time.perf_counter() - tick, 1))
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
    with open(os.path.join(hlo_dir, f"{spec.key()}.hlo"), "w") as f:
      f.write(gp.hlo)
  return row


def cuda_plugin() -> str:
  """The installed jax-cuda12-plugin's version (the compile-only GPU target), or 'absent'."""
  import importlib.metadata
  try:
    return importlib.metadata.version("jax-cuda12-plugin")
  except importlib.metadata.PackageNotFoundError:
    return "absent"


def device_text() -> str:
  """What a result's metadata says its device was."""
  return f"compile-only H100s (XLA:GPU, jax-cuda12-plugin {cuda_plugin()}) on this CPU host"


def _spec_text(gp) -> str:
  from moejax.strategy.spec import from_config
  return from_config(gp.program.cfg, gpus(gp.topology)).spec


class Cache:
  """Program rows by `Spec.key()` in one JSON file: a program compiled once is read back."""

  def __init__(self, path: str | None):
    self.path = path
    self.rows: dict[str, dict] = {}
    if path and os.path.exists(path):
      with open(path) as f:
        self.rows = json.load(f)

  def get(self, spec: Spec, gpu: str = "h100", hlo_dir: str | None = None,
          log=print) -> dict:
    key = spec.key()
    if key not in self.rows:
      log(f"compiling {spec}")
      self.rows[key] = compile_row(spec, gpu, hlo_dir)
      row = self.rows[key]
      log(f"  {'compiled' if row['compiled'] else row['error']}: "
          f"{row.get('compile_s', '')} s compile, step {row.get('step_s', 0):.3f} s, "
          f"wall {row['wall_s']} s")
      self.save()
    return self.rows[key]

  def save(self) -> None:
    """Writes the rows, with any another process added to the file meanwhile."""
    if self.path:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      if os.path.exists(self.path):
        with open(self.path) as f:
          self.rows = {**json.load(f), **self.rows}
      with open(self.path + ".tmp", "w") as f:
        json.dump(self.rows, f)
      os.replace(self.path + ".tmp", self.path)


# The numbers of a program row that scale with its buffer and with its depth.
SCALED = ("step_s", "compute_s", "comm_s", "exposed_comm_s", "by_category", "comm_by",
          "exposed_by", "compute_by", "grouped_matmul", "peak_bytes")


def fits(peak_bytes: float, gpu: str) -> bool:
  """Whether a program's peak fits the share of the GPU's memory that train.py gives JAX's
  allocator (XLA_PYTHON_CLIENT_MEM_FRACTION)."""
  return peak_bytes <= GPU_MEMORY_FRACTION * gpu_info(gpu).memory_bytes


def _linear(lo: dict, hi: dict, w: float) -> dict:
  """`lo` + w (`hi` - `lo`) for every number of `SCALED` (nested dicts key by key); whether
  the result fits its GPU from its peak."""

  def mix(a, b):
    if isinstance(a, dict):
      return {k: mix(a.get(k, 0.0), b.get(k, 0.0)) for k in set(a) | set(b)}
    if isinstance(a, bool) or not isinstance(a, (int, float)):
      return b
    return a + w * (b - a)

  out = {k: mix(lo[k], hi[k]) for k in SCALED}
  out.update(compiled=True, gpu=lo["gpu"],
             fits=fits(out["peak_bytes"], lo["gpu"]))
  return out


def interpolate(lo: dict, hi: dict, f_lo: float, f_hi: float, factor: float) -> dict:
  """A program row at `factor` between two compiled ones: every number linear between them
  (the step, the grouped matmul, each collective's time and exposure, the peak)."""
  return {**_linear(lo, hi, (factor - f_lo) / (f_hi - f_lo)), "interpolated": [f_lo, f_hi]}


def extrapolate(cut: dict[int, dict], depth: int) -> dict:
  """A program row at `depth` layers from the rows of the same program compiled at two cut
  depths: the layers are one scanned loop, so every number is a fixed part (embedding, loss,
  optimizer over the rest) plus depth x a per-layer part: the step, each category and
  collective and its exposure, the grouped matmul, the peak. `per_layer_s` is the step's
  per-layer part; `extrapolated` the two depths."""
  (a, ra), (b, rb) = sorted((int(d), r) for d, r in cut.items())
  per_layer = (rb["step_s"] - ra["step_s"]) / (b - a)
  return {**_linear(ra, rb, (depth - a) / (b - a)), "extrapolated": [a, b], "depth": depth,
          "per_layer_s": per_layer}


def at_depth(cache: Cache, spec: Spec, depths: tuple[int, int] | None = None,
             hlo_dir: str | None = None, log=print) -> dict:
  """`spec`'s program row with the keys of the programs compiled for it (`programs`): the
  program itself, or, with `depths`, the program at those two depths and its row
  extrapolated to `spec`'s depth (`spec.layers`, 0: the model's)."""
  if not depths:
    return {**cache.get(spec, hlo_dir=hlo_dir, log=log), "programs": [spec.key()]}
  cuts = [dataclasses.replace(spec, layers=d) for d in depths]
  cut = {s.layers: cache.get(s, hlo_dir=hlo_dir, log=log) for s in cuts}
  keys = [s.key() for s in cuts]
  failed = [r for r in cut.values() if not r["compiled"]]
  if failed:
    return {"compiled": False, "error": failed[0]["error"], "programs": keys}
  depth = spec.layers or config(spec).model.num_layers
  return {**extrapolate(cut, depth), "programs": keys}


def busiest_step(row: dict, busiest_over_mean: float, factor: float) -> dict:
  """The step of program `row` when the busiest device computes `busiest_over_mean` times the
  balanced rows (T*K) and its buffer holds `factor` times them: the grouped matmul's time
  scaled by their ratio, the rest as compiled (a first-order correction: the overlap of the
  exchange with the compute is the compiled one's)."""
  grouped = row["grouped_matmul"]["seconds"]
  fill = min(1.0, busiest_over_mean / factor)
  return {"scaled_step_s": row["step_s"] - grouped * (1.0 - fill),
          "grouped_matmul_s": grouped * fill, "buffer_fill": fill}
