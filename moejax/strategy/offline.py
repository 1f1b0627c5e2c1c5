"""Offline stage: enumerate strategies, rank them per load regime, pick a small pool.

`python -m moejax.plan --gin_file=configs/X.gin [--profile h100_node|profile.json]
[--devices N] [--pool K] [--max_drop F] [--trace T.npz] [--json OUT]` prints one row
per strategy (predicted step time and dropped share under each regime, memory per
device, why rejected) and the pool: the best strategy of each load regime (uniform,
skewed, collapsed), then runners-up across regimes, at most `--pool` <= 4. With a routing
trace of the run (`trace.path`), the even regime gives way to the `observed` one: the
expert shares of the trace's last steps, per layer, and their count dispersion (a
trained router is seldom even, so an even regime underrates drops). A strategy's
score under a regime is its predicted step time if it drops at most `max_drop` of
the (token, k) choices there; otherwise it only competes on drops.
Pure (numpy + config); the CLI parses gin through moejax.frontend.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import Config, ConfigError
from moejax.strategy.cost import HardwareProfile, StepCost, Workload, predict_step
from moejax.strategy.spec import Strategy, factorizations, space, why_invalid

REGIMES = ("uniform", "skewed", "collapse")
OBSERVED_REGIMES = ("observed", "skewed", "collapse")     # with measured expert shares


def regime_load(name: str, num_experts: int, seed: int = 0) -> np.ndarray:
  """Expert shares (sum 1) of a load regime: even; log-normal (sigma 1; busiest ~2-3x the
  mean, as in static-layout Mixtral training); a collapsed gate whose top expert takes 40%."""
  if name == "uniform":
    return np.full(num_experts, 1.0 / num_experts)
  if name == "skewed":
    p = np.random.default_rng(seed).lognormal(0.0, 1.0, num_experts)
    return np.sort(p)[::-1] / p.sum()
  if name == "collapse":
    rest = 0.6 * 0.5 ** np.arange(1, num_experts) if num_experts > 1 else np.zeros(0)
    p = np.concatenate([[0.4], rest]) + 1e-3
    return p / p.sum()
  if name == "observed":
    raise ConfigError("load regime 'observed' needs measured expert shares: pass observed_LxE "
                      "(or --trace to moejax.plan).")
  raise ConfigError(f"load regime {name!r} is unknown; use one of {REGIMES} or 'observed'.")


def workload_of(cfg: Config) -> Workload:
  m, moe = cfg.model, cfg.moe
  return Workload(m.d_model, m.num_layers, m.num_heads, m.d_ff, m.vocab_size, cfg.data.seq_len,
                  cfg.data.global_batch_size, moe.num_experts, moe.top_k, moe.d_ff,
                  moe.moe_every, act_bytes=4 if m.dtype == "float32" else 2,
                  first_dense=moe.first_dense,
                  shared_d_ff=moe.num_shared_experts * (moe.shared_d_ff or moe.d_ff),
                  remat=m.remat, remat_keeps_exchange=m.remat_keeps_exchange,
                  loss_chunk=m.loss_chunk,
                  attention_scores=m.attention != "cudnn",
                  ragged_buffer_factor=moe.ragged_buffer_factor, kernels=moe.kernels,
                  pooled=moe.capacity == "device", **_latent(m))


def _latent(m) -> dict:
  """Multi-head latent attention's projection parameters and head widths (moejax.model.mla)."""
  if not m.kv_lora_rank:
    return {}
  d, h, qk = m.d_model, m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
  query = (d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk if m.q_lora_rank else
           d * h * qk)
  keys = (d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank +
          m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim))
  return {"attention_params": query + keys + h * m.v_head_dim * d,
          "attention_width": h * (qk + m.v_head_dim)}


@dataclasses.dataclass
class Row:
  strategy: Strategy
  costs: dict[str, StepCost]          # regime -> prediction (empty when invalid)
  rejected: str | None = None
  in_pool: bool = False

  def score(self, regime: str, max_drop: float) -> tuple[int, float]:
    """Lower is better: (0, step time) when the drop limit holds, else (1, drops)."""
    c = self.costs[regime]
    return (0, c.total_s) if c.drop_fraction <= max_drop else (1, c.drop_fraction)


def rank(cfg: Config, profile: HardwareProfile, num_devices: int,
         candidates: list[Strategy] | None = None, regimes=REGIMES,
         dispersion: float = 1.0, observed_LxE: np.ndarray | None = None) -> list[Row]:
  """Every candidate's predicted cost per regime (or why it is rejected); `dispersion`: how
  much a source's count per expert varies beyond independent tokens (drops grow with it);
  `observed_LxE`: measured expert shares per MoE layer, the `observed` regime's load."""
  w = workload_of(cfg)
  loads = {}
  for r in regimes:
    if r == "observed" and observed_LxE is not None:
      loads[r] = np.asarray(observed_LxE, np.float64)
      if loads[r].ndim != 2 or loads[r].shape[1] != cfg.moe.num_experts or (
          len(loads[r]) not in (1, w.moe_layers)):
        raise ConfigError(f"observed expert shares have shape {loads[r].shape}; this model "
                          f"needs [{w.moe_layers} MoE layers (or 1), {cfg.moe.num_experts} "
                          "experts]: record the trace with the same model.")
    else:
      loads[r] = regime_load(r, cfg.moe.num_experts)[None]
  rows = []
  if candidates is None:
    candidates = space(cfg, num_devices, kernel_options=kernel_options(cfg, profile))
  for s in candidates:
    reason = why_invalid(s, cfg)
    if reason:
      rows.append(Row(s, {}, reason))
      continue
    costs = {r: predict_step(s, w, profile, loads[r], dispersion) for r in regimes}
    mem = max(c.memory_bytes for c in costs.values())
    if mem > profile.memory_bytes:
      reason = f"needs {mem / 2**30:.2f} GiB > {profile.memory_bytes / 2**30:.2f} GiB"
    rows.append(Row(s, costs, reason))
  return rows


def best_rows(rows: list[Row], regime: str, max_drop: float) -> list[Row]:
  """The valid rows, best first by `regime`'s score (what `moejax.plan --verify` compiles)."""
  return sorted((r for r in rows if r.rejected is None), key=lambda r: r.score(regime, max_drop))


def kernel_options(cfg: Config, profile: HardwareProfile) -> tuple[str, ...]:
  """The expert kernels the search tries for per-slot buffers: the config's, and where the
  profile rates a grouped matmul apart from a dense dot (a GPU's) the other as well, since
  which pays turns on the capacity factor: XLA's einsum computes the whole buffer at the dense
  dot's rate, the grouped kernel the rows it holds at its own."""
  if not profile.grouped_flops_per_s:
    return ("",)
  return ("", "xla" if cfg.moe.kernels == "pallas" else "pallas")


def _kind(reason: str) -> str:
  """The kind of a rejection, for grouping: its words before the first value."""
  if reason.startswith("needs ") and "GiB" in reason:
    return "device memory"
  if "global_batch_size" in reason:
    return "global batch over data*expert"
  if "model axis" in reason:
    return "model axis divisibility"
  return reason.split("=")[0].split(" (")[0]


def _fits(cfg: Config, profile: HardwareProfile, num_devices: int, **rank_kwargs) -> bool:
  return any(r.rejected is None for r in rank(cfg, profile, num_devices, **rank_kwargs))


def why_nothing_fits(cfg: Config, profile: HardwareProfile, num_devices: int, rows: list[Row],
                     **rank_kwargs) -> list[str]:
  """When every candidate is rejected: how many were rejected for each kind of reason, with
  an example, then the smallest changes that would make one fit: the global batch, the
  device count, the memory per device (each found by ranking again with it changed)."""
  kinds: dict[str, list[Row]] = {}
  for r in rows:
    kinds.setdefault(_kind(r.rejected or ""), []).append(r)
  lines = [f"{len(rs)} of {len(rows)} rejected for {kind}, e.g. {rs[0].strategy.spec}: "
           f"{rs[0].rejected}" for kind, rs in sorted(kinds.items(), key=lambda kv: -len(kv[1]))]
  fixes = []
  batch = cfg.data.global_batch_size
  shards = sorted({d * e for d, e, _ in factorizations(num_devices)})
  for need in sorted({-(-batch // de) * de for de in shards} - {batch}):
    bigger = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, global_batch_size=need))
    if _fits(bigger, profile, num_devices, **rank_kwargs):
      fixes.append(f"data.global_batch_size = {need} (a multiple of data*expert for some "
                   f"mesh of {num_devices} devices)")
      break
  devices = num_devices // 2
  while devices >= 1:
    if _fits(cfg, profile, devices, **rank_kwargs):
      fixes.append(f"--devices {devices} (the most devices, halving, on which one fits at "
                   f"data.global_batch_size = {batch})")
      break
    devices //= 2
  short = kinds.get("device memory", [])
  devices = num_devices * 2
  while short and devices <= 16384:   # more devices hold less each
    if _fits(cfg, profile, devices, **rank_kwargs):
      fixes.append(f"--devices {devices} (the fewest, doubling, that hold it in memory)")
      break
    devices *= 2
  if short:
    least = min(max(c.memory_bytes for c in r.costs.values()) for r in short)
    fixes.append(f"a profile with at least {least / 2**30:.2f} GiB per device (this one has "
                 f"{profile.memory_bytes / 2**30:.2f} GiB)")
  lines.append("smallest changes that make one fit: " + ("; or ".join(fixes) if fixes else
               "none found by changing the batch, the device count or the memory alone"))
  return lines


def pick_pool(rows: list[Row], k: int, max_drop: float, regimes=REGIMES) -> list[Strategy]:
  """Best per regime first (so the pool covers the regimes), then the next best of each
  regime in turn, without duplicates, until K."""
  if not 1 <= k <= 4:
    raise ConfigError(f"--pool={k} must be in [1, 4]; every member is a compiled program.")
  ok = [r for r in rows if r.rejected is None]
  if not ok:
    devices = rows[0].strategy.num_devices if rows else 0
    raise ConfigError(f"no strategy fits this model on {devices} devices; the lines above say "
                      "why and what would make one fit.")
  # Members share the first pick's pipeline and FSDP choice (spec.check_pool, decision 0045).
  first = min(ok, key=lambda r: r.score(regimes[0], max_drop)).strategy
  ok = [r for r in ok if pipeline_of(r.strategy) == pipeline_of(first)]
  ordered = {g: sorted(ok, key=lambda r, g=g: r.score(g, max_drop)) for g in regimes}
  pool: list[Strategy] = []
  for depth in range(len(ok)):
    for g in regimes:
      s = ordered[g][depth].strategy
      if s not in pool and len(pool) < k:
        pool.append(s)
    if len(pool) >= k:
      break
  for r in rows:
    r.in_pool = r.strategy in pool
  return pool


def pipeline_of(s: Strategy) -> tuple:
  """What pool members share: stages, virtual stages, microbatches, FSDP."""
  return s.stage, s.virtual, s.microbatches, s.fsdp


def train_bindings(pool: list[Strategy]) -> list[str]:
  """The gin bindings that train `pool`: the pipeline and FSDP fields its members share,
  then the pool (a lone member under stages: its mesh and capacity, nothing to switch)."""
  s = pool[0]
  out = [f"{name} = {value!r}" for name, value, default in (
      ("mesh.stage", s.stage, 1), ("train.microbatches", s.microbatches, 1),
      ("train.pipeline_schedule", "circular" if s.virtual > 1 else "gpipe", "gpipe"),
      ("train.virtual_stages", s.virtual, 1), ("mesh.fsdp", s.fsdp, False)) if value != default]
  if s.stage > 1 and len(pool) == 1:
    return out + [f"mesh.data = {s.data}", f"mesh.expert = {s.expert}",
                  f"mesh.model = {s.model}", f"moe.capacity_factor = {s.capacity_factor:g}",
                  f"moe.dispatch = {s.dispatch!r}"]
  return out + ["strategy.pool = [" + ", ".join(repr(m.spec) for m in pool) + "]"]


def table(rows: list[Row], regimes=REGIMES) -> str:
  """One line per strategy: predicted ms and drops per regime, the peak bytes per device
  (`MiB/dev`), the parameters + Adam moments per device (`state MiB`), the status."""
  width = max([24] + [len(r.strategy.spec) + 2 for r in rows])
  head = f"{'strategy':<{width}}" + "".join(f"{g + ' ms':>13}{'drop':>7}" for g in regimes)
  head += f"{'MiB/dev':>10}{'state MiB':>11}  status"
  lines = [head, "-" * len(head)]
  for r in sorted(rows, key=lambda r: (r.rejected is not None, not r.in_pool,
                                      r.costs[regimes[0]].total_s if r.costs else 0.0)):
    cells = "".join(f"{r.costs[g].total_s * 1e3:13.2f}{r.costs[g].drop_fraction:7.1%}"
                    if r.costs else f"{'-':>13}{'-':>7}" for g in regimes)
    mem = max(c.memory_bytes for c in r.costs.values()) / 2**20 if r.costs else float("nan")
    state = next(iter(r.costs.values())).state_bytes / 2**20 if r.costs else float("nan")
    status = "POOL" if r.in_pool else ("ok" if r.rejected is None else f"rejected: {r.rejected}")
    lines.append(f"{r.strategy.spec:<{width}}{cells}{mem:10.1f}{state:11.1f}  {status}")
  return "\n".join(lines)


def to_json(rows: list[Row], pool: list[Strategy], profile: HardwareProfile) -> dict:
  return {"profile": profile.to_dict(), "pool": [s.spec for s in pool],
          "rows": [{"strategy": r.strategy.spec, "rejected": r.rejected, "in_pool": r.in_pool,
                    "costs": {g: c.to_dict() for g, c in r.costs.items()}} for r in rows]}
