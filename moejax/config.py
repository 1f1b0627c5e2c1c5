"""Frozen configuration dataclasses, one per concern.

This module imports nothing from JAX so that `train.py` can parse gin files and
decide how many host devices to fake *before* JAX is imported. Every default of
the project lives here; `train.py` only binds values to these classes.
"""

from __future__ import annotations

import dataclasses
import math


class ConfigError(ValueError):
  """A user-facing configuration error: one line naming the value and the fix."""


PALLAS_BACKENDS = ("auto", "interpret", "triton", "mosaic_gpu")   # pallas_kernels.backend's
# MoEConfig's string knobs and the values each accepts (tests/test_modes.py enumerates them).
MOE_CHOICES = {
    "expert_mode": ("ep", "fsep"), "dispatch": ("dense", "ragged"), "kernels": ("xla", "pallas"),
    "pallas_backend": PALLAS_BACKENDS, "capacity": ("slot", "device"),
    "gate": ("softmax", "sigmoid"), "fsep_shares": ("planned", "adaptive")}
_MOE_CHOICE_HINTS = {
    "dispatch": " ('ragged': dropless, GPU/TPU only)",
    "pallas_backend": " ('auto' picks by platform and GPU)",
    "capacity": " ('slot': per (source, slot) buffers; 'device': pooled per (source, device))"}

# Field annotation (a string: postponed annotations) -> accepted types.
_FIELD_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
                "str | None": (str, type(None))}


def check_field_types(name: str, obj) -> None:
  """Gin accepts any literal; reject e.g. `model.d_model = 'abc'` with one line."""
  for field in dataclasses.fields(obj):
    allowed = _FIELD_TYPES.get(field.type)
    value = getattr(obj, field.name)
    if allowed and (not isinstance(value, allowed) or
                    (isinstance(value, bool) and bool not in allowed)):
      raise ConfigError(
          f"{name}.{field.name}={value!r} has type {type(value).__name__} but must be "
          f"{field.type}; e.g. {name}.{field.name} = {field.default!r}.")


def batch_split_error(batch: int, shards: int, name: str = "batch") -> str | None:
  """Why `batch` rows cannot be split evenly over `shards` = data*expert devices (None: they
  can); the one home of the rule for the trainer, the strategy space and the MoE layer."""
  if batch % shards:
    return (f"{name}={batch} is not divisible by data*expert={shards} devices; "
            f"use a multiple of {shards}")
  return None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the named mesh axes; -1 means "all remaining devices"."""
  data: int = -1
  expert: int = 4
  model: int = 1
  host_device_count: int = 8      # CPU devices train.py fakes with no XLA_FLAGS (GPU hosts: 1)
  stage: int = 1   # pipeline stages of whole layer groups; data*expert*model devices each
  fsdp: bool = False   # ZeRO-3: params and Adam moments sharded over `data` (mesh.FSDP_RULES)

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    """(data, expert, model) with a single -1 replaced by the remaining factor; the product
    times mesh.stage must be `num_devices`."""
    if self.stage < 1 or num_devices % self.stage:
      raise ConfigError(f"mesh.stage={self.stage} does not divide the {num_devices} devices; "
                        f"use a divisor of {num_devices} (1: no pipeline).")
    num_devices //= self.stage
    names = ("data", "expert", "model")
    sizes = [self.data, self.expert, self.model]
    bad = [(n, s) for n, s in zip(names, sizes) if s == 0 or s < -1]
    if bad:
      raise ConfigError(f"mesh.{bad[0][0]}={bad[0][1]} is invalid; use a positive size or -1.")
    if sizes.count(-1) > 1:
      raise ConfigError(f"mesh sizes {dict(zip(names, sizes))} have more than one -1; "
                        "set all but one axis explicitly.")
    if -1 in sizes:
      known = math.prod(s for s in sizes if s != -1)
      if num_devices % known:
        raise ConfigError(
            f"mesh sizes {dict(zip(names, sizes))} cannot fill {num_devices} devices: "
            f"{num_devices} is not divisible by {known}; fix the mesh or mesh.host_device_count.")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      per_stage = f" per stage (mesh.stage={self.stage})" if self.stage > 1 else ""
      raise ConfigError(
          f"mesh sizes {dict(zip(names, sizes))} multiply to {math.prod(sizes)} but there are "
          f"{num_devices} devices{per_stage}; make the product {num_devices} or set one axis "
          "to -1.")
    return tuple(sizes)


def microbatch_split_error(batch: int, microbatches: int, shards: int) -> str | None:
  """Why batch / microbatches rows cannot split over `shards` = data*expert devices (None: can)."""
  rows = batch // microbatches
  if rows % shards:
    return (f"train.microbatches={microbatches} leaves {rows} rows per microbatch of "
            f"data.global_batch_size={batch}, not divisible by data*expert={shards} devices; "
            f"use a global batch that is a multiple of {microbatches * shards}")
  return None


def default_fsep_slots(num_experts: int, num_devices: int) -> int:
  """fsep C when moe.slots_per_device = 0: about one extra replica per expert, <= E per device."""
  return min(num_experts, 2 * -(-num_experts // num_devices))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 8
  top_k: int = 2
  capacity_factor: float = 1.25
  d_ff: int = 256                 # hidden size of each expert's SwiGLU
  balance_loss_weight: float = 0.01
  z_loss_weight: float = 1e-3
  normalize_top_k: bool = True    # renormalise the k gate weights to sum to one (k > 1)
  moe_every: int = 2              # every moe_every-th MLP is an MoE layer
  expert_mode: str = "ep"         # "ep" (slot owns weights) or "fsep" (sharded, restored)
  slots_per_device: int = 0       # fsep: expert slots per device C (0: min(E, 2 * ceil(E/N)))
  dispatch: str = "dense"         # "dense" (fixed capacity all_to_all) or "ragged" (dropless, GPU)
  kernels: str = "xla"            # "xla" or "pallas" (permute/combine/grouped-matmul kernels)
  # pallas: "auto" (CPU: interpret; GPU: Triton, the grouped matmul on Mosaic GPU on Hopper
  # in bf16/f16), or "triton" | "mosaic_gpu" | "interpret" (see pallas_kernels.backend)
  pallas_backend: str = "auto"
  capacity: str = "slot"          # dense: "slot" (cap per (source, slot)) or "device" (pooled)
  exchange_chunks: int = 1        # dense: split each layer's dispatch into K independent pieces
  ragged_buffer_factor: float = 2.0   # ragged: receive rows = factor*T*K per device (0: N*T*K)
  fsep_shares: str = "planned"    # or "adaptive": levelled on each step's counts (layout.adaptive)
  # Router family (moejax.model.moe.route). "softmax": softmax scores, switch balance loss
  # over the batch. "sigmoid": sigmoid scores, gates normalised over the chosen k, a
  # sequence-wise balance loss (DeepSeek-V3's; balance_loss_weight scales it, 0 = off).
  gate: str = "softmax"
  route_scale: float = 1.0        # multiplies the k gate values (DeepSeek-V3: 2.5)
  # Aux-loss-free balancing: each step bias_e += bias_rate * sign(mean load - load_e); the
  # bias picks experts, never weights them (TrainState.router_bias_LxE; 0: a fixed bias).
  bias_rate: float = 0.0
  num_shared_experts: int = 0     # dense SwiGLU experts every token goes through
  shared_d_ff: int = 0            # hidden width of each shared expert (0: moe.d_ff)
  # Device-limited routing: a token picks its device_limit best devices under the current
  # layout (by the best biased score each hosts), then its top-k among their experts (0: off).
  device_limit: int = 0
  first_dense: int = 0            # dense (non-MoE) first layers before the scanned groups
  # Each MoE layer replaced by one dense SwiGLU of width top_k * d_ff (the active FLOPs of
  # its k experts, no routing or exchange): the baseline that MoE overhead is measured against.
  dense_equivalent: bool = False

  def validate(self) -> None:
    for name in ("num_experts", "d_ff", "moe_every", "exchange_chunks"):
      if getattr(self, name) < 1:
        raise ConfigError(f"moe.{name}={getattr(self, name)} must be >= 1.")
    if not 1 <= self.top_k <= self.num_experts:
      raise ConfigError(
          f"moe.top_k={self.top_k} must be in [1, moe.num_experts={self.num_experts}]; "
          "lower top_k or add experts.")
    if not self.capacity_factor > 0:
      raise ConfigError(
          f"moe.capacity_factor={self.capacity_factor} must be > 0; use e.g. 1.25 "
          "(1.0 = exactly the balanced share per expert).")
    for name, allowed in MOE_CHOICES.items():
      if getattr(self, name) not in allowed:
        raise ConfigError(f"moe.{name}={getattr(self, name)!r} is not supported; use one of "
                          f"{', '.join(map(repr, allowed))}{_MOE_CHOICE_HINTS.get(name, '')}.")
    if self.slots_per_device < 0:
      raise ConfigError(f"moe.slots_per_device={self.slots_per_device} must be >= 0.")
    if self.ragged_buffer_factor < 0:
      raise ConfigError(f"moe.ragged_buffer_factor={self.ragged_buffer_factor} must be >= 0; "
                        "use e.g. 2.0 (0: size the buffer for the worst case, N x the send rows).")
    self.validate_router()

  def validate_router(self) -> None:
    if not self.route_scale > 0:
      raise ConfigError(f"moe.route_scale={self.route_scale} must be > 0; use e.g. 1.0.")
    if self.bias_rate < 0:
      raise ConfigError(f"moe.bias_rate={self.bias_rate} must be >= 0; use e.g. 0.001 (0: the "
                        "router bias never changes).")
    for name in ("num_shared_experts", "shared_d_ff", "device_limit", "first_dense"):
      if getattr(self, name) < 0:
        raise ConfigError(f"moe.{name}={getattr(self, name)} must be >= 0 (0: off).")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256           # 0: the data's (moejax.train.data.resolve_vocab)
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 0           # k/v heads, each shared by num_heads / num_kv_heads (0: MHA)
  head_dim: int = 0               # 0: d_model // num_heads
  qk_norm: str = "none"           # q, k RMSNorm before RoPE: per "head" (Qwen3), whole "proj"
  d_ff: int = 512                 # hidden size of the dense SwiGLU MLPs
  max_seq_len: int = 128
  rope_base: float = 10000.0
  norm_eps: float = 1e-6
  dtype: str = "float32"          # activation/compute dtype; params are float32
  remat: bool = False
  # "auto": the fused cuDNN kernel on GPU where it applies (bf16/fp16, head dim a multiple of
  # 8 up to 128), XLA's attention elsewhere; "xla" | "cudnn" force one (chosen at build time).
  attention: str = "auto"
  # Positions per tile of the tiled cross-entropy (moejax.train.loss): the [tokens, vocab]
  # logits are never held whole; 0: plain logits (fine for small vocabularies).
  loss_chunk: int = 0

  def validate(self, moe: MoEConfig) -> None:
    if self.vocab_size < 0:
      raise ConfigError(f"model.vocab_size={self.vocab_size} must be >= 1, or 0 for the data's.")
    for name in ("d_model", "num_layers", "num_heads", "d_ff", "max_seq_len"):
      if getattr(self, name) < 1:
        raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1.")
    if self.attention not in ("auto", "xla", "cudnn"):
      raise ConfigError(f"model.attention={self.attention!r} is not supported; use 'auto', "
                        "'xla' or 'cudnn'.")
    if self.loss_chunk < 0:
      raise ConfigError(f"model.loss_chunk={self.loss_chunk} must be >= 0; use e.g. 256 "
                        "(0: plain logits).")
    if moe.dense_equivalent and moe.expert_mode != "ep":
      raise ConfigError(f"moe.dense_equivalent=True has no experts to shard with moe.expert_mode"
                        f"={moe.expert_mode!r}; use moe.expert_mode = 'ep'.")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ConfigError(f"model.dtype={self.dtype!r} is not supported; use 'float32', "
                        "'bfloat16' or 'float16'.")
    head_dim, kv = self.head_dim or self.d_model // self.num_heads, self.num_kv_heads or 1
    if (not self.head_dim and self.d_model % self.num_heads) or head_dim % 2 or min(
        self.head_dim, self.num_kv_heads) < 0 or self.num_heads % kv:
      raise ConfigError(
          f"model.d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads="
          f"{self.num_kv_heads}, head_dim={self.head_dim}: need num_kv_heads dividing num_heads "
          "and an even head dim for RoPE (head_dim, or 0: d_model / num_heads, a whole number).")
    if self.qk_norm not in ("none", "head", "proj"):
      raise ConfigError(f"model.qk_norm={self.qk_norm!r} is not supported; use 'none', 'head' "
                        "(per head, Qwen3) or 'proj' (whole projection, OLMoE).")
    if moe.first_dense >= self.num_layers or (self.num_layers - moe.first_dense) % moe.moe_every:
      raise ConfigError(
          f"model.num_layers={self.num_layers} minus moe.first_dense={moe.first_dense} must be "
          f"a positive multiple of moe.moe_every={moe.moe_every} (layers after the dense first "
          "ones are scanned in groups ending in an MoE layer).")


def num_moe_layers(model: ModelConfig, moe: MoEConfig) -> int:
  """MoE layers of the model: the groups after the `moe.first_dense` dense first layers."""
  return (model.num_layers - moe.first_dense) // moe.moe_every


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # None: the embedded corpus (Python stdlib sources, byte-level). Otherwise a directory
  # prepared by `python -m moejax.prepare_data` (its meta.json gives vocab and dtype), a
  # .bin/.npy token file (one stream) or any other file read as bytes.
  path: str | None = None
  bin_dtype: str = "uint16"       # element type of a raw .bin token file (not a directory's)
  seq_len: int = 128
  global_batch_size: int = 16
  val_fraction: float = 0.05
  max_corpus_bytes: int = 16 * 2**20
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 3e-3
  warmup_steps: int = 30
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip_norm: float = 1.0
  decay_steps: int = 0   # cosine horizon; 0: train.num_steps at the start (saved, kept on resume)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 100
  keep: int = 2


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  run_dir: str = "runs/default"
  num_steps: int = 300
  eval_every: int = 100
  eval_batches: int = 4
  seed: int = 0
  progress_bar: bool = True
  tensorboard: bool = True        # event files (tensorboardX) beside metrics.jsonl, process 0
  # A step with a non-finite loss or gradient is skipped; this many in a row stop the run.
  max_consecutive_nonfinite: int = 5
  force_unlock: bool = False      # take a run dir locked by another host (one that is gone)
  microbatches: int = 1           # rows i % M == m; accumulated, or piped with mesh.stage > 1
  pipeline_schedule: str = "gpipe"   # or "circular": virtual_stages layer chunks per stage
  virtual_stages: int = 1         # V (moejax.model.pipeline): 1 for gpipe, >= 2 for circular
  restart: bool = False   # start at 0 over an earlier run, its files moved to RUN_DIR/previous.N/
  init_from: str | None = None    # a run dir whose weights start this one (moejax.convert)


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
  """Online expert placement (dyn.X): re-plan every `every` steps from finished steps."""
  policy: str = "static"          # "static" or "smartmoe" in ep mode (replay has more)
  every: int = 50                 # re-plan period in steps; 0 = never
  fsep_every: int = 0             # the period in fsep mode (moves no weights); 0 = `every`
  window: int = 10                # finished steps averaged into the predicted load
  min_gain: float = 0.05          # hysteresis: min relative drop of predicted max device load
  # Read each step's metrics before dispatching the next: the re-planner and the online stage
  # then decide on the step just finished (1 step late, not 2), but the host's work between
  # steps (reading, planning, the next batch) no longer overlaps the device's.
  fresh: bool = False
  fsep_plan_for: str = "spread"   # fsep: plan for the window's spread, or "mean" (its mean load)
  fsep_locality: bool = True      # fsep: each device's own tokens to its own replica first

  def validate(self, expert_mode: str = "ep") -> None:
    allowed = {"ep": ("static", "smartmoe"), "fsep": ("static", "fsep")}[expert_mode]
    if self.policy not in allowed:
      raise ConfigError(
          f"planner.policy={self.policy!r} cannot run in training with moe.expert_mode="
          f"{expert_mode!r}; use one of {list(allowed)} (replay also has 'shadow').")
    if self.every < 0 or self.fsep_every < 0 or self.window < 1 or self.min_gain < 0:
      raise ConfigError(f"planner.every={self.every}, planner.fsep_every={self.fsep_every}, "
                        f"planner.window={self.window}, planner.min_gain={self.min_gain}: need "
                        "every >= 0, fsep_every >= 0, window >= 1, min_gain >= 0.")
    if not isinstance(self.fresh, bool):
      raise ConfigError(f"planner.fresh={self.fresh!r} must be True or False.")
    if self.fsep_plan_for not in ("spread", "mean") or not isinstance(self.fsep_locality, bool):
      raise ConfigError(f"planner.fsep_plan_for={self.fsep_plan_for!r}, planner.fsep_locality="
                        f"{self.fsep_locality!r}: use 'spread' or 'mean', and True or False.")


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
  """The online stage: every `every` steps, switch to the compiled pool member predicted
  fastest under the current load among those dropping at most `max_drop` (moejax.strategy.
  switcher) when its gain over `horizon` steps beats the measured switch cost. Pool specs
  ('ep/2x4x1/cf1.25') come from `python -m moejax.plan`; the first member starts."""
  pool: tuple = ()                # empty: the single strategy given by mesh.* and moe.*
  every: int = 0                  # decision period in steps; 0 = never switch
  profile: str = "cpu"            # hardware profile: a preset name or a calibrated JSON
  max_drop: float = 0.01          # dropped share of (token, k) choices a member may cause
  horizon: int = 0                # steps a time switch must pay off over; 0 = `every`

  def validate(self) -> None:
    if not isinstance(self.pool, (tuple, list)) or not all(isinstance(p, str) for p in self.pool):
      raise ConfigError(f"strategy.pool={self.pool!r} must be a list of specs such as "
                        "['ep/2x4x1/cf1.25', 'fsep/1x8x1/c2/cf1.25'].")
    if len(self.pool) > 4:
      raise ConfigError(f"strategy.pool has {len(self.pool)} members; keep at most 4.")
    if self.every < 0 or not 0 <= self.max_drop <= 1:
      raise ConfigError(f"strategy.every={self.every}, strategy.max_drop={self.max_drop}: need "
                        "every >= 0 and 0 <= max_drop <= 1.")
    if self.horizon < 0:
      raise ConfigError(f"strategy.horizon={self.horizon} must be >= 0 (0: strategy.every).")


@dataclasses.dataclass(frozen=True)
class TraceConfig:
  """Routing trace written to `path` when set: an .npz of counts[steps, layers, sources,
  experts], top_k and step (moejax.placement.trace)."""
  path: str | None = None


# Fields whose range no other check covers: {field: the range in words}, the tests below.
_RANGES = {"mesh.host_device_count": ">= 1", "data.seq_len": ">= 1", "optim.b1": "in [0, 1)",
           "data.global_batch_size": ">= 1", "optim.learning_rate": "> 0", "optim.b2": "in [0, 1)",
           "optim.warmup_steps": ">= 0", "optim.decay_steps": ">= 0", "train.eval_every": ">= 1",
           "optim.weight_decay": ">= 0", "optim.grad_clip_norm": "> 0", "train.num_steps": ">= 0",
           "optim.min_lr_ratio": "in [0, 1]", "checkpoint.keep": ">= 1", "checkpoint.every": ">= 1",
           "train.eval_batches": ">= 1", "train.max_consecutive_nonfinite": ">= 1"}
_TESTS = {">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, "> 0": lambda v: v > 0,
          "in [0, 1]": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1}


@dataclasses.dataclass(frozen=True)
class Config:
  """The whole run. Built by train.py from gin bindings, or directly in code."""
  mesh: MeshConfig = MeshConfig()
  model: ModelConfig = ModelConfig()
  moe: MoEConfig = MoEConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  train: TrainConfig = TrainConfig()
  planner: PlannerConfig = PlannerConfig()
  trace: TraceConfig = TraceConfig()
  strategy: StrategyConfig = StrategyConfig()

  def validate(self) -> Config:
    for field in dataclasses.fields(self):
      check_field_types(field.name, getattr(self, field.name))
    for key, need in _RANGES.items():
      part, name = key.split(".")
      if not _TESTS[need](value := getattr(getattr(self, part), name)):
        default = getattr(type(getattr(self, part)), name)
        raise ConfigError(f"{key}={value} must be {need}; use e.g. {key} = {default}.")
    self.moe.validate()
    self.planner.validate(self.moe.expert_mode)
    self.strategy.validate()
    self.model.validate(self.moe)
    self._validate_pipeline()
    if self.data.seq_len > self.model.max_seq_len:
      raise ConfigError(
          f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}.")
    return self

  def _validate_pipeline(self) -> None:
    stage, micro, moe, t = self.mesh.stage, self.train.microbatches, self.moe, self.train
    groups, virtual = num_moe_layers(self.model, moe), t.virtual_stages
    if stage < 1:
      raise ConfigError(f"mesh.stage={stage} must be >= 1 (1: no pipeline).")
    if (t.pipeline_schedule, min(virtual, 2)) not in (("gpipe", 1), ("circular", 2)):
      raise ConfigError(f"train.pipeline_schedule={t.pipeline_schedule!r} with train.virtual_"
                        f"stages={virtual}: use 'gpipe' with 1, or 'circular' with 2 or more.")
    if groups % (stage * virtual):
      fix = moe.first_dense + stage * virtual * moe.moe_every * max(1, groups // stage // virtual)
      raise ConfigError(
          f"model.num_layers={self.model.num_layers} makes {groups} layer groups, not divisible "
          f"by mesh.stage={stage} x train.virtual_stages={virtual}; use model.num_layers = {fix} "
          f"or a mesh.stage x train.virtual_stages dividing {groups}.")
    if micro < 1 or self.data.global_batch_size % micro:
      raise ConfigError(
          f"train.microbatches={micro} does not divide data.global_batch_size="
          f"{self.data.global_batch_size}; use a divisor of {self.data.global_batch_size}.")
    if virtual > 1 and micro < stage:    # stage 0 re-reads a microbatch M ticks after it
      raise ConfigError(f"train.pipeline_schedule='circular' needs train.microbatches={micro} "
                        f">= mesh.stage={stage}; use train.microbatches = {stage} or more.")

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)
