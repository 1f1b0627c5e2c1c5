"""What a run does with the program: data, optimizer, checkpoints, the loop, online
placement, the strategy pool, traces, and `Config`, the whole run."""

from __future__ import annotations

import dataclasses

from moejax.config.checks import ConfigError, check_field_types, check_ranges
from moejax.config.program import MeshConfig, ModelConfig, MoEConfig, num_moe_layers


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


BF16_MOMENT_MAX_BETA = 0.99   # 1 - beta >= 2^-7: two rounding steps of a bfloat16 moment


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
  # Adam's mu and nu: "float32", or "bfloat16" (half their memory and optimizer bytes; the
  # moments are updated in float32 and rounded when stored).
  moments_dtype: str = "float32"

  def validate(self) -> None:
    if self.moments_dtype not in ("float32", "bfloat16"):
      raise ConfigError(f"optim.moments_dtype={self.moments_dtype!r} is not supported; use "
                        "'float32' or 'bfloat16'.")
    # bfloat16 keeps 8 significant bits: a moment's per-step change of (1 - b) of itself is
    # lost to rounding once it falls under about 2^-8, and the moment stops following the
    # gradients.
    if self.moments_dtype == "bfloat16" and max(self.b1, self.b2) > BF16_MOMENT_MAX_BETA:
      raise ConfigError(
          f"optim.moments_dtype='bfloat16' with optim.b1={self.b1}, optim.b2={self.b2}: a "
          f"bfloat16 moment cannot follow an update of (1 - beta) < "
          f"{1 - BF16_MOMENT_MAX_BETA:.2g} of itself; use betas <= {BF16_MOMENT_MAX_BETA} or "
          "optim.moments_dtype = 'float32'.")


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
  # Apply a re-plan `lag` steps after it was due: it is planned on a thread while those steps
  # train (0: at once, on the loop's thread). The layouts depend on `lag`, not on timing.
  lag: int = 0
  fsep_plan_for: str = "spread"   # fsep: plan for the window's spread, or "mean" (its mean load)
  fsep_locality: bool = True      # fsep: each device's own tokens to its own replica first
  # Consider a re-plan after every finished step and switch a layer when its predicted compute
  # gain over `every` steps (fsep_every under fsep) beats the migration of what moves. None:
  # the expert mode's default, on where a switch moves no weights (fsep: every better plan
  # pays), off where it moves weights and Adam moments (ep: the fixed period).
  adaptive: bool | None = None

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
    if self.adaptive is not None and not isinstance(self.adaptive, bool):
      raise ConfigError(f"planner.adaptive={self.adaptive!r} must be True, False or None (the "
                        "expert mode's default); True prices every step's re-plan against its "
                        "migration.")
    if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 0:
      raise ConfigError(f"planner.lag={self.lag!r} must be an integer >= 0 (0 applies a re-plan "
                        "at once; 1 plans it while the next step trains).")
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
    check_ranges(self)
    self.moe.validate()
    self.optim.validate()
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
    # Stages run the model as moejax.model.pipeline, which has no multi-token head; one
    # stage's microbatches are the train step's own loop, which runs the whole model.
    if self.model.mtp_depth and (stage > 1 or virtual > 1):
      raise ConfigError(f"model.mtp_depth={self.model.mtp_depth} runs without pipeline stages "
                        f"(mesh.stage={stage}, train.virtual_stages={virtual}); use mesh.stage = "
                        "1 and train.virtual_stages = 1 (microbatches are fine), or "
                        "model.mtp_depth = 0.")
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
