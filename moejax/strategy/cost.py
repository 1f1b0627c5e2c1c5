"""The whole-step cost model of a strategy: `HardwareProfile` + `predict_step`.

The step time comes from FLOPs (matmuls), bytes touched (elementwise work), and the volume of
every collective (token all_to_all, FSEP restore, gradient and tensor-parallel reductions),
given the expected expert load: dense dispatch computes its fixed capacity and drops what
overflows it; ragged dispatch computes the busiest device's rows. Presets come from public
specs and measurements (the GPUs': moejax.strategy.hardware's table, with sources);
`python -m moejax.calibrate` fits a profile to the current machine by micro-benchmarks.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from moejax.config import ConfigError
from moejax.layout import capacity
from moejax.placement.fsep import dhondt_counts
from moejax.strategy import calls, stages
from moejax.strategy.hardware import GPU_RATES
from moejax.strategy.memory import (
  FP32,
  activation_bytes,
  expert_bytes,
  expert_params,
  step_bytes,
)


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """Sustained rates per device. `concurrency` = devices that really run at once (0 = all;
  fake CPU devices share the host's cores)."""
  name: str
  flops_per_s: float             # matmul FLOP/s (dense dots)
  mem_bytes_per_s: float         # elementwise / memory-bound work
  a2a_bytes_per_s: float         # all_to_all: bytes a device sends per second
  reduce_bytes_per_s: float      # all-reduce / reduce-scatter bus bandwidth
  latency_s: float               # per collective call
  overhead_s: float              # fixed per step (launches, host work)
  memory_bytes: float            # usable device memory
  concurrency: float = 0.0
  latency_per_device_s: float = 0.0   # extra per call and per device in the group
  # Whole-step fit (moejax.strategy.profile_fit.fit_steps): measured steps of a few calibration
  # strategies vs the composed prediction; scales the compute and the collective terms.
  compute_scale: float = 1.0
  comm_scale: float = 1.0
  tp_scale: float = 1.0          # tensor-parallel psums, fitted apart from other collectives
  # The gradient reduce and FSDP's gathers run beside the backward pass's matmuls (async
  # collectives under XLA's latency-hiding scheduler on GPU, moejax.runtime.xla_flags): only
  # what the matmuls cannot cover is step time. Not on fake CPU devices, which share cores.
  overlap_param_comm: bool = False
  p2p_bytes_per_s: float = 0.0   # stage-boundary sends (0: the all_to_all rate)
  # A grouped matmul over uneven row groups (ragged dispatch, pooled capacity, or per-slot
  # buffers through moe.kernels = 'pallas': the Pallas kernel on GPU, or with 'xla' JAX's
  # ragged_dot, taken at the same rate) runs well below a dense dot of the same size
  # (decision 0058).
  grouped_flops_per_s: float = 0.0   # 0: flops_per_s

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def expert_flops_per_s(self, grouped: bool) -> float:
    """The expert matmuls' rate: a grouped matmul's (`grouped_experts`), else a batched dense
    dot's (per-slot capacity buffers through XLA's einsum)."""
    if grouped and self.grouped_flops_per_s:
      return self.grouped_flops_per_s
    return self.flops_per_s

  def call_s(self, group: int) -> float:
    """Fixed cost of one collective over `group` devices."""
    return self.latency_s + self.latency_per_device_s * group


def load_profile(name_or_path: str) -> HardwareProfile:
  """A preset name (see PRESETS), a JSON file written by `python -m moejax.calibrate`, or a
  `benchmarks/strategy/cost_model.py` result (its whole-step fitted `profile`)."""
  if name_or_path in PRESETS:
    return PRESETS[name_or_path]
  try:
    with open(name_or_path) as f:
      data = json.load(f)
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
      data = data["profile"]
    return HardwareProfile(**data)
  except (OSError, TypeError, ValueError) as e:
    raise ConfigError(f"hardware profile {name_or_path!r} is neither a preset "
                      f"({', '.join(PRESETS)}) nor a readable profile JSON ({e}); run "
                      "`python -m moejax.calibrate --out profile.json`.") from None


# The H100 presets read moejax.strategy.hardware's table (each rate with its source): the
# sustained dense-dot and grouped-kernel rates and the HBM rate measured on one H100, the
# collective rates and latencies of its links. "node": 8 GPUs on NVLink; "cluster": the
# expert all_to_all crosses nodes on the network. The A100 presets keep assumed rates
# (0.5 of the 312 TFLOP/s peak, 0.7 of HBM; A100: 200 Gb/s per GPU across nodes).
_H100 = GPU_RATES["h100"]
_H100_DOT, _H100_GROUPED = _H100.gemm_flops_per_s.value, _H100.grouped_flops_per_s.value
_H100_HBM = _H100.hbm_bytes_per_s.value
_NODE, _CLUSTER = _H100.node, _H100.cluster
PRESETS = {
    "a100_node": HardwareProfile("a100_node", 156e12, 1.4e12, 120e9, 150e9, 25e-6, 2e-3,
                                 80 * 2**30, overlap_param_comm=True),
    "a100_cluster": HardwareProfile("a100_cluster", 156e12, 1.4e12, 20e9, 40e9, 40e-6, 2e-3,
                                    80 * 2**30, overlap_param_comm=True),
    "h100_node": HardwareProfile("h100_node", _H100_DOT, _H100_HBM, _NODE.a2a_bytes_per_s.value,
                                 _NODE.reduce_bytes_per_s.value, _NODE.latency_s.value, 1.5e-3,
                                 80 * 2**30, overlap_param_comm=True,
                                 grouped_flops_per_s=_H100_GROUPED),
    "h100_cluster": HardwareProfile("h100_cluster", _H100_DOT, _H100_HBM,
                                    _CLUSTER.a2a_bytes_per_s.value,
                                    _CLUSTER.reduce_bytes_per_s.value, _CLUSTER.latency_s.value,
                                    1.5e-3, 80 * 2**30, overlap_param_comm=True,
                                    grouped_flops_per_s=_H100_GROUPED),
    # Nodes of 8 H100s with the expert axis inside a node (NVLink all_to_all, as h100_node)
    # and the data and stage axes across nodes (the network's gradient reduce and stage
    # sends, as h100_cluster's reduce and all_to_all rates).
    "h100_ep_node": HardwareProfile("h100_ep_node", _H100_DOT, _H100_HBM,
                                    _NODE.a2a_bytes_per_s.value,
                                    _CLUSTER.reduce_bytes_per_s.value, _CLUSTER.latency_s.value,
                                    1.5e-3, 80 * 2**30, overlap_param_comm=True,
                                    p2p_bytes_per_s=_CLUSTER.a2a_bytes_per_s.value,
                                    grouped_flops_per_s=_H100_GROUPED),
    # Uncalibrated guess for fake CPU devices (2 cores); run `python -m moejax.calibrate`.
    "cpu": HardwareProfile("cpu", 30e9, 5e9, 2e9, 2e9, 50e-6, 5e-3, 8 * 2**30, 2.0),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """What the model and batch are, in the numbers the step cost needs."""
  d_model: int
  num_layers: int
  num_heads: int
  d_ff: int                      # dense MLPs
  vocab_size: int
  seq_len: int
  global_batch: int
  num_experts: int
  top_k: int
  expert_d_ff: int
  moe_every: int
  act_bytes: int = 4
  first_dense: int = 0           # dense first layers (moe.first_dense)
  shared_d_ff: int = 0           # all shared experts' width together, per MoE layer
  remat: bool = False            # model.remat: each layer group's forward runs again
  remat_keeps_exchange: bool = False   # ... but for the MoE exchanges and the down projection
  loss_chunk: int = 0            # model.loss_chunk: positions of logits per loss tile (0: all)
  attention_scores: bool = True  # XLA's attention materialises [B, H, Q, Q] (cuDNN's: none)
  ragged_buffer_factor: float = 2.0   # moe.ragged_buffer_factor: the ragged receive buffer
  kernels: str = "xla"           # moe.kernels (a strategy's own `kernels` overrides it)
  pooled: bool = False           # moe.capacity = 'device'
  # Per layer, the attention's projection parameters (0: multi-head's 4 d^2) and per token the
  # heads' q.k plus value widths (0: 2 d); multi-head latent attention sets both.
  attention_params: int = 0
  attention_width: int = 0

  @property
  def attention(self) -> int:
    """One layer's attention parameters with its two RMSNorms (2 d)."""
    return (self.attention_params or 4 * self.d_model * self.d_model) + 2 * self.d_model

  @property
  def residual_width(self) -> int:
    """Per token and layer, the residuals a layer keeps: 20 d with multi-head attention's
    q, k, v and output (4 d) replaced by twice the heads' widths."""
    return 16 * self.d_model + 2 * (self.attention_width or 2 * self.d_model)

  @property
  def moe_layers(self) -> int:
    return (self.num_layers - self.first_dense) // self.moe_every

  @property
  def dense_params(self) -> int:
    """Everything but the expert FFNs (replicated over data and expert)."""
    d = self.d_model
    dense_mlps = self.num_layers - self.moe_layers
    return (2 * self.vocab_size * d + self.num_layers * self.attention +
            dense_mlps * 3 * d * self.d_ff + self.moe_layers * d * self.num_experts +
            self.moe_layers * 3 * d * self.shared_d_ff)

  @property
  def expert_params(self) -> int:
    return self.moe_layers * self.num_experts * 3 * self.d_model * self.expert_d_ff


@dataclasses.dataclass(frozen=True)
class StepCost:
  compute_s: float               # dense matmuls (attention, MLPs, logits)
  expert_s: float                # expert matmuls on the busiest device
  memory_s: float                # elementwise work and the optimizer update
  a2a_s: float                   # token dispatch + combine, forward and backward
  restore_s: float               # fsep restore + its gradient reduce-scatter
  reduce_s: float                # gradient all-reduce over data, router psums
  tp_s: float                    # tensor-parallel activation psums (model axis)
  overhead_s: float
  drop_fraction: float           # predicted share of (token, k) choices dropped
  memory_bytes: float            # per device
  pipe_s: float = 0.0            # stage-boundary transfers (pipeline)
  hidden_s: float = 0.0          # parameter collectives hidden behind matmuls (not in total)
  bubble: float = 0.0            # the pipeline schedule's idle share of the ticks
  state_bytes: float = 0.0       # parameters + Adam moments per device
  gather_bytes: float = 0.0      # FSDP's parameter gathers: bytes a device receives a step

  @property
  def total_s(self) -> float:
    return (self.compute_s + self.expert_s + self.memory_s + self.a2a_s + self.restore_s +
            self.reduce_s + self.tp_s + self.pipe_s + self.overhead_s)

  def to_dict(self) -> dict:
    return dict(dataclasses.asdict(self), total_s=self.total_s)


def _lpt_max_share(p_E: np.ndarray, devices: int, slots: int) -> float:
  """Busiest device's share when one-copy experts are packed greedily (C per device)."""
  load_N, free_N = np.zeros(devices), np.full(devices, slots)
  for share in np.sort(p_E)[::-1]:
    d = int(np.argmin(np.where(free_N > 0, load_N, np.inf)))
    load_N[d] += share
    free_N[d] -= 1
  return float(load_N.max())


def expected_overflow(mean: np.ndarray, cap: float, var: np.ndarray | None = None) -> np.ndarray:
  """E[max(X - cap, 0)] for a source's count X to one slot, X ~ Normal(mean, var); var
  defaults to the mean (independent binomial choices). Mean-field loads alone would predict
  no drops at all below capacity."""
  mean = np.asarray(mean, np.float64)
  sd = np.sqrt(np.maximum(mean if var is None else np.asarray(var, np.float64), 1e-12))
  z = (cap - mean) / sd
  pdf = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
  tail = 0.5 * np.vectorize(math.erfc)(z / math.sqrt(2))
  return np.maximum(sd * pdf + (mean - cap) * tail, 0.0)


def _expert_rows(strategy, w: Workload, p_E: np.ndarray, tokens: float,
                 dispersion: float = 1.0) -> tuple[float, float, float]:
  """(rows the busiest device holds per MoE layer, dropped fraction, rows its expert matmuls
  compute) for one layer's
  expert shares `p_E` (summing to 1); `tokens` per source device. A source's count to an
  expert has variance `dispersion` x its mean (1: independent tokens; real batches cluster,
  see `load_dispersion`); r replicas split it in fixed parts, so each part has 1/r^2 of it."""
  n, e, k = strategy.expert, w.num_experts, w.top_k
  c = strategy.slots(e)
  choices = tokens * k                             # per source device
  if strategy.expert_mode == "ep":                 # the busiest device's share of the rows
    share = _lpt_max_share(p_E, n, c)
  else:
    share = max(float(np.max(p_E / dhondt_counts(p_E, n * c, n))) * c, 1.0 / n)
  if strategy.dispatch == "ragged":                # dropless: rows follow the load
    return choices * n * share, 0.0, choices * n * share
  cap = np.ceil(strategy.capacity_factor * choices / (n * c))
  if strategy.expert_mode == "ep":
    reps = np.ones(e)                              # one slot per expert
  else:
    reps = dhondt_counts(p_E, n * c, n).astype(np.float64)
  mean = choices * p_E / reps
  dropped = float(np.sum(expected_overflow(mean, cap, dispersion * mean / reps) * reps)) / choices
  buffer = float(n * c * cap)
  # The exchange moves and the program holds the whole buffer; a grouped matmul computes
  # only the rows in it, not its padding: at most the routed rows of the busiest device.
  computed = min(buffer, choices * n * share) if grouped_experts(strategy, w) else buffer
  return buffer, dropped, computed


def runs_grouped(dispatch: str, kernels: str, pooled: bool) -> bool:
  """Whether the experts run as a grouped matmul over their row groups (ragged dispatch;
  pooled capacity; per-slot buffers with moe.kernels = 'pallas'), not as XLA's batched einsum
  over whole per-slot buffers (moejax.model.moe.layer)."""
  return dispatch == "ragged" or pooled or kernels == "pallas"


def grouped_experts(strategy, w: Workload) -> bool:
  """`runs_grouped` for `strategy` (its `kernels`, else the config's) on `w`."""
  return runs_grouped(strategy.dispatch, strategy.kernels or w.kernels, w.pooled)


def slot_weights(strategy, w: Workload) -> float:
  """Elements of one MoE layer's slot weights (w_gate, w_up, w_down) a device computes with:
  its C slots, the FFN dim split over `model`."""
  return strategy.slots(w.num_experts) * 3 * w.d_model * w.expert_d_ff / strategy.model


def restore_bytes(strategy, w: Workload) -> float:
  """Bytes of one MoE layer's slot weights an fsep device restores: cast to the compute dtype
  before the exchange (moejax.model.moe.restore), and under FSDP each restore moves its 1/data
  of the embed dim (the stored shards as they lie)."""
  return slot_weights(strategy, w) * w.act_bytes / (strategy.data if strategy.fsdp else 1)


def predict_step(strategy, w: Workload, profile: HardwareProfile,
                 load_LxE: np.ndarray | None = None, dispersion: float = 1.0) -> StepCost:
  """Predicted step time of `strategy` (moejax.strategy.Strategy) on `profile` when the MoE
  layers' expert shares are `load_LxE` (rows sum to 1; None = uniform) and a source's count
  to an expert varies `dispersion` times more than independent tokens would. With P stages a
  device runs its stage's layers for every tick (moejax.strategy.stages): the layer terms are
  the busiest stage's, stretched by the bubble; embedding and head run on every stage."""
  d, f, e = w.d_model, w.expert_d_ff, w.num_experts
  dd, n, m = strategy.data, strategy.expert, strategy.model
  p, mb, v = strategy.stage, strategy.microbatches, strategy.virtual
  fs = dd if strategy.fsdp else 1                 # FSDP splits parameters over data
  devices = strategy.num_devices
  scale = max(1.0, devices / profile.concurrency) if profile.concurrency else 1.0
  tokens = w.global_batch * w.seq_len / (dd * n)   # per device (model axis shares them)
  if load_LxE is None:
    load_LxE = np.full((1, e), 1.0 / e)
  load_LxE = np.asarray(load_LxE, np.float64)
  load_LxE = load_LxE / np.maximum(load_LxE.sum(-1, keepdims=True), 1e-12)
  c = strategy.slots(e)
  per_row = {}                                     # one evaluation per distinct load row
  for row in np.broadcast_to(load_LxE, (w.moe_layers, e)):
    key = row.tobytes()
    if key not in per_row:
      rows, dropped, computed = _expert_rows(strategy, w, row, tokens / mb, dispersion)
      per_row[key] = (rows * mb, dropped, computed * mb)   # capacity is per microbatch
  rows_L, drops_L, computed_L = (np.array([per_row[r.tobytes()][i] for r in np.broadcast_to(
      load_LxE, (w.moe_layers, e))]) for i in (0, 1, 2))
  stage_rows = stages.busiest_stage(rows_L, p, v)  # the stage's expert rows, all microbatches
  computed_rows = stages.busiest_stage(computed_L, p, v)   # ... that its matmuls compute
  stretch = stages.stretch(p, mb, v)               # ticks / busy ticks: the bubble
  # A device's layers: 1/P of the groups, and every dense first layer, which each stage
  # computes on the whole batch like the embedding (moejax.model.pipeline).
  layers = (w.num_layers - w.first_dense) / p + w.first_dense
  moe_layers = w.moe_layers / p
  runs = moe_layers * mb * stretch                 # MoE layer runs per device (every tick)
  recompute = 4 / 3 if w.remat else 1.0            # remat runs the forward twice
  keeps = calls.keeps_exchange(strategy, w)
  # a recomputed MoE layer (fsep's always) runs its forward twice; with the exchanges' outputs
  # kept, the experts' recomputed forward is gate and up only
  expert_recompute = (11 / 9 if keeps else 4 / 3) if calls.recomputes_moe(strategy, w) else 1.0

  # causal QK^T and AV per token, over the heads' widths (multi-head: d each)
  attn_flops = 2 * w.seq_len * (w.attention_width or 2 * d) / 2
  first = w.first_dense * (w.attention + 3 * d * w.d_ff)   # on every stage, no bubble
  layer_dense = w.dense_params - 2 * w.vocab_size * d - first      # split over the stages
  dense_flops = ((6 * tokens * layer_dense / p + 3 * tokens * (layers - w.first_dense) *
                  attn_flops) / m * stretch * recompute + 6 * tokens * w.vocab_size * d / m +
                 (6 * tokens * first + 3 * tokens * w.first_dense * attn_flops) / m * recompute)
  expert_flops = 6 * computed_rows * 3 * d * f / m * stretch * expert_recompute
  compute_s = dense_flops * scale / profile.flops_per_s
  expert_s = expert_flops * scale / profile.expert_flops_per_s(grouped_experts(strategy, w))

  ep_local = expert_params(strategy.expert_mode, w.moe_layers, e, d, f, n, m) / p
  dense_dev = (layer_dense / p + first + 2 * w.vocab_size * d) / m     # before FSDP
  params_dev = (dense_dev + ep_local) / fs
  act_bytes = (40 * tokens * d * layers + 12 * stage_rows * d) * w.act_bytes / m * stretch
  opt_bytes = 7 * 4 * params_dev                   # read p, g, mu, nu; write p, mu, nu
  memory_s = (act_bytes + opt_bytes) * scale / profile.mem_bytes_per_s

  call = profile.call_s
  a2a_s = 0.0
  if n > 1:        # dispatch + combine, forward and backward, and again where recomputed
    buf = stage_rows * stretch * d * w.act_bytes / m          # bytes over all runs
    a2a_s = calls.exchanges_per_run(strategy, w) * (
        runs * call(n) + buf * (n - 1) / n / profile.a2a_bytes_per_s) * scale
  restore_s = 0.0
  if strategy.expert_mode == "fsep" and n > 1:   # 3 weights: restore twice, gradient return
    per_layer = restore_bytes(strategy, w)
    moved = per_layer * (n - 1) / n / profile.a2a_bytes_per_s
    restore_s = (runs * (calls.RESTORE_PER_RUN * call(n) + 3 * moved) +
                 calls.restore_per_step(p) * call(n) + 2 * moved) * scale
  # Gradients: dense leaves over data*expert, expert leaves over data; under FSDP the data
  # part is a reduce-scatter (half an all-reduce's volume). Calls: combined buckets per
  # layer group run (moejax.strategy.calls). The embedding's and head's gradients need no
  # sum over stages: every stage computes them from the same collected outputs. A layer
  # group's gradients are reduced where its backward runs, once per run: a pipelined step
  # reduces its stage's groups in every tick (ticks / V runs), the rest once a step.
  shards, groups = dd * n, max(w.moe_layers, 1)
  group_bytes = 4 * (layer_dense / groups / m + (ep_local * p / groups if n == 1 else 0)) / fs
  per_tick = stages.ticks(p, mb, v) / v
  stage_dense = layer_dense / p / m               # the stage's layer groups' dense part
  param_bytes = 0.0
  if shards > 1:
    param_bytes = 4 * ((dense_dev - stage_dense + stage_dense * per_tick) * 2 * (shards - 1) /
                       shards + ep_local * per_tick * 2 * (dd - 1) / dd) / (
        2 if strategy.fsdp else 1)
  gathers = stages.gather_runs(p, mb, v, w.remat) if strategy.fsdp else 0.0
  reduce_s = sum(k * call(g) for k, g in calls.reduce_calls(
      strategy, runs, group_bytes, 4 * ep_local * p / groups / fs,
      gathers * moe_layers)) * scale
  gather_bytes = 0.0
  if strategy.fsdp and dd > 1:   # in the compute dtype: the weights are cast, then gathered
    # ep gathers its E/N stored experts; fsep each layer's C restored slots (restored on the
    # shards, then gathered whole where the MoE layer computes)
    ep_gathered = (slot_weights(strategy, w) * w.moe_layers / p
                   if strategy.expert_mode == "fsep" else ep_local)
    gather_bytes = (
        stages.fsdp_gather_bytes(w.act_bytes * (stage_dense + ep_gathered), dd, gathers) +
        stages.fsdp_gather_bytes(w.act_bytes * (dense_dev - stage_dense), dd))
    if strategy.expert_mode == "fsep" and p == 1:
      # the backward restores a layer ahead and gathers it with the restore
      # (moejax.model.moe.fsep_backward): the first layer's run restores and gathers one more,
      # the wrap nobody reads
      gather_bytes += stages.fsdp_gather_bytes(w.act_bytes * slot_weights(strategy, w), dd,
                                               gathers, passes=1)
    param_bytes += gather_bytes
  param_s = param_bytes / profile.reduce_bytes_per_s * scale
  hidden = 0.0
  if profile.overlap_param_comm:   # their volume hides behind the backward's matmuls
    hidden = min(param_s, 2 / 3 * (compute_s + expert_s) * profile.compute_scale /
                 profile.comm_scale)
  reduce_s += param_s - hidden
  tp_s = 0.0
  if m > 1:        # two activation psums per layer, forward and backward
    volume = 4 * layers * tokens * stretch * d * w.act_bytes * 2 * (m - 1) / m
    tp_s = (calls.tp_calls(layers, moe_layers, mb * stretch) * call(m) +
            volume / profile.reduce_bytes_per_s) * scale
  pipe_s = stages.transfer_seconds(p, mb, v, tokens, d, w.act_bytes, call(2),
                                   profile.p2p_bytes_per_s or profile.a2a_bytes_per_s) * scale

  buffer_rows = stage_rows      # what the expert matmuls hold: ragged's fixed buffer
  if strategy.dispatch == "ragged":
    buffer_rows = capacity.ragged_rows(tokens / mb, w.top_k, n, w.ragged_buffer_factor) * (
        mb * moe_layers)
  experts = expert_bytes(strategy.expert_mode, w.moe_layers // p, e, d, f, n, m, c,
                         w.act_bytes, fs, stages=p)
  # One stage runs its microbatches one forward and backward at a time, adding gradients in
  # place (moejax.train.step.accumulated_loss_and_grads): a microbatch's activations at the
  # peak. Stages keep every tick's (a pipeline's scan over ticks).
  act_tokens, act_rows, act_mb = (tokens / mb, buffer_rows / mb, 1) if p == 1 else (
      tokens, buffer_rows, mb)
  memory_bytes = step_bytes(
      dense_dev / fs, experts,
      activation_bytes(act_tokens, d, layers, w.vocab_size, act_rows, w.act_bytes, m,
                       groups=round(moe_layers), remat=w.remat, microbatches=act_mb,
                       stretch=stretch, heads=w.num_heads, seq_len=w.seq_len,
                       attention_scores=w.attention_scores, loss_chunk=w.loss_chunk,
                       remat_blocks=strategy.expert_mode == "fsep",
                       residual_width=w.residual_width, first_dense=w.first_dense,
                       keeps_exchange=keeps))
  cs, ms = profile.compute_scale, profile.comm_scale
  return StepCost(compute_s * cs, expert_s * cs, memory_s * cs, a2a_s * ms, restore_s * ms,
                  reduce_s * ms, tp_s * profile.tp_scale, profile.overhead_s,
                  float(np.mean(drops_L)), float(memory_bytes), pipe_s=pipe_s * ms,
                  hidden_s=hidden * ms, bubble=stages.bubble_fraction(p, mb, v),
                  state_bytes=3 * FP32 * dense_dev / fs + experts["persistent"],
                  gather_bytes=gather_bytes)


def expert_shares(counts_stepsxLxWxE: np.ndarray) -> np.ndarray:
  """Expert shares [L, E] (rows sum to 1) of finished steps' counts [steps, L, W, E]."""
  c = np.asarray(counts_stepsxLxWxE, np.float64)
  if c.ndim != 4 or c.shape[0] < 1:
    raise ConfigError(f"expert shares need counts[steps, layers, sources, experts] with at "
                      f"least one step, got shape {c.shape}.")
  counts_LxE = c.sum(axis=(0, 2))
  return counts_LxE / np.maximum(counts_LxE.sum(-1, keepdims=True), 1.0)


def load_dispersion(counts_stepsxLxWxE: np.ndarray) -> float:
  """How much more a source's count to an expert varies than independent tokens would:
  mean of (X - m)^2 / m over steps, layers, sources and experts, where m is the count the
  source would send at the window's mean shares. Byte-level batches repeat tokens within a
  sequence, so this is several times 1 (about 6-9 in the default run after warm-up)."""
  x = np.asarray(counts_stepsxLxWxE, np.float64)
  if len(x) == 0:
    return 1.0
  m = x.sum(-1, keepdims=True) * expert_shares(x)[None, :, None, :]
  ok = m > 0
  if not ok.any():
    return 1.0
  return float(max(np.mean((x - m)[ok] ** 2 / m[ok]), 1.0))
