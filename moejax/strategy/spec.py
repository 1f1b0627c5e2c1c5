"""Strategies: the static shape of one compiled train step, and the space of them.

A strategy fixes what the compiler must know: the mesh factorization (data x
expert x model; the data axis doubles as the expert-data-parallel group, i.e. each
expert is replicated over `data`), the pipeline (P stages of data x expert x model
devices each, M microbatches, V virtual stages per device: 1 = GPipe, more = the
circular schedule), ZeRO-3 (`fsdp`: parameters and Adam moments sharded over data),
the expert mode (`ep` / `fsep`), the slots per device C, the capacity factor, the
dispatch kind and, for per-slot buffers, the expert kernels (XLA's batched einsum over whole
buffers or the grouped matmul over the rows they hold). One strategy = one compiled program;
the layout inside it stays data.
JAX-free, so planners and the offline search are plain Python.

A strategy is written as a short spec, e.g. `ep/2x4x1/cf1.25`,
`fsep/1x8x1/c2/cf1.25[/ragged]`, `ep/1x4x1/p2/m8/cf1.25/fsdp` or `ep/8x8x1/cf1/xla`
(`pP`, `vV`, `mM` and `fsdp` appear only when not 1 / off, and `xla` / `pallas` only where
the strategy sets moe.kernels rather than keeping the config's, so a spec without them is the
one of before).
"""

from __future__ import annotations

import dataclasses
import itertools

from moejax.config import (
  Config,
  ConfigError,
  batch_split_error,
  default_fsep_slots,
  microbatch_split_error,
  num_moe_layers,
)

_MODES = ("ep", "fsep")
_DISPATCH = ("dense", "ragged")
_KERNELS = ("xla", "pallas")       # moe.kernels
_COUNTS = {"p": "stage", "v": "virtual", "m": "microbatches"}     # spec letter -> field


@dataclasses.dataclass(frozen=True, order=True)
class Strategy:
  data: int
  expert: int
  model: int
  expert_mode: str = "ep"
  slots_per_device: int = 0        # fsep C (0 = moejax default); ep always E/N
  capacity_factor: float = 1.25
  dispatch: str = "dense"
  stage: int = 1                   # P: pipeline stages (mesh.stage)
  microbatches: int = 1            # M (train.microbatches)
  virtual: int = 1                 # V: layer chunks per stage (train.virtual_stages)
  fsdp: bool = False               # mesh.fsdp
  kernels: str = ""                # moe.kernels ("": the config's)

  @property
  def num_devices(self) -> int:
    return self.stage * self.data * self.expert * self.model

  def slots(self, num_experts: int) -> int:
    """C: slots each expert-axis device hosts."""
    if self.expert_mode == "ep":
      return max(1, num_experts // self.expert)
    return self.slots_per_device or default_fsep_slots(num_experts, self.expert)

  @property
  def spec(self) -> str:
    parts = [self.expert_mode, f"{self.data}x{self.expert}x{self.model}"]
    for letter, value in (("p", self.stage), ("v", self.virtual), ("m", self.microbatches)):
      if value != 1:
        parts.append(f"{letter}{value}")
    if self.expert_mode == "fsep":
      parts.append(f"c{self.slots_per_device}")
    parts.append(f"cf{self.capacity_factor:g}")
    if self.dispatch != "dense":
      parts.append(self.dispatch)
    if self.kernels:
      parts.append(self.kernels)
    if self.fsdp:
      parts.append("fsdp")
    return "/".join(parts)

  def __str__(self) -> str:
    return self.spec

  def apply(self, cfg: Config) -> Config:
    """`cfg` with this strategy's mesh and MoE fields; the planner policy follows the mode
    (a non-static policy becomes the mode's own re-planner). V > 1 sets the circular
    schedule, on a build whose TrainConfig has it (`train.virtual_stages`)."""
    mesh = dataclasses.replace(cfg.mesh, data=self.data, expert=self.expert, model=self.model,
                               stage=self.stage, fsdp=self.fsdp)
    train = dataclasses.replace(cfg.train, microbatches=self.microbatches, **_schedule_fields(
        cfg, self.virtual))
    moe = dataclasses.replace(cfg.moe, expert_mode=self.expert_mode,
                              slots_per_device=self.slots_per_device if
                              self.expert_mode == "fsep" else 0,
                              capacity_factor=self.capacity_factor, dispatch=self.dispatch,
                              kernels=self.kernels or cfg.moe.kernels)
    policy = cfg.planner.policy
    if policy != "static":
      policy = "smartmoe" if self.expert_mode == "ep" else "fsep"
    planner = dataclasses.replace(cfg.planner, policy=policy)
    return dataclasses.replace(cfg, mesh=mesh, moe=moe, planner=planner, train=train)


def _schedule_fields(cfg: Config, virtual: int) -> dict:
  """train.pipeline_schedule / virtual_stages for V, where this build's TrainConfig has them
  (no fields: only V = 1, GPipe, can be expressed)."""
  if not hasattr(cfg.train, "virtual_stages"):
    return {}
  return {"virtual_stages": virtual, "pipeline_schedule": "circular" if virtual > 1 else "gpipe"}


def parse(spec: str) -> Strategy:
  """`ep/2x4x1/cf1.25`, `fsep/1x8x1/c2/cf1.5/ragged`, `ep/1x4x1/p2/m8/cf1.25/fsdp` ->
  Strategy (one-line errors)."""
  example = ("e.g. 'ep/2x4x1/cf1.25', 'fsep/1x8x1/c2/cf1.25', 'ep/8x8x1/cf1/xla' or "
             "'ep/1x4x1/p2/m8/cf1.25/fsdp'")
  parts = spec.strip().split("/")
  if len(parts) < 2 or parts[0] not in _MODES:
    raise ConfigError(f"strategy {spec!r} must start with a mode in {_MODES} and a mesh; "
                      f"{example}.")
  try:
    data, expert, model = (int(v) for v in parts[1].split("x"))
  except ValueError:
    raise ConfigError(f"strategy {spec!r}: mesh {parts[1]!r} must be DATAxEXPERTxMODEL; "
                      f"{example}.") from None
  fields = {"expert_mode": parts[0]}
  for part in parts[2:]:
    try:
      if part in _DISPATCH:
        fields["dispatch"] = part
      elif part in _KERNELS:
        fields["kernels"] = part
      elif part == "fsdp":
        fields["fsdp"] = True
      elif part[:1] in _COUNTS and part[1:].isdigit():
        fields[_COUNTS[part[0]]] = int(part[1:])
      elif part.startswith("cf"):
        fields["capacity_factor"] = float(part[2:])
      elif part.startswith("c"):
        fields["slots_per_device"] = int(part[1:])
      else:
        raise ValueError
    except ValueError:
      raise ConfigError(f"strategy {spec!r}: unknown part {part!r}; {example}.") from None
  if min(data, expert, model, *(fields.get(f, 1) for f in _COUNTS.values())) < 1:
    raise ConfigError(f"strategy {spec!r}: mesh sizes, p, v and m must be >= 1; {example}.")
  return Strategy(data, expert, model, **fields)


def from_config(cfg: Config, num_devices: int) -> Strategy:
  """The strategy a config describes (mesh -1 resolved against `num_devices`)."""
  sizes = cfg.mesh.resolve(num_devices)
  slots = cfg.moe.slots_per_device if cfg.moe.expert_mode == "fsep" else 0
  return Strategy(*sizes, expert_mode=cfg.moe.expert_mode, slots_per_device=slots,
                  capacity_factor=cfg.moe.capacity_factor, dispatch=cfg.moe.dispatch,
                  stage=cfg.mesh.stage, microbatches=cfg.train.microbatches,
                  virtual=getattr(cfg.train, "virtual_stages", 1), fsdp=cfg.mesh.fsdp)


def factorizations(num_devices: int) -> list[tuple[int, int, int]]:
  """Every (data, expert, model) with product `num_devices`."""
  out = []
  for data in range(1, num_devices + 1):
    if num_devices % data:
      continue
    rest = num_devices // data
    for expert in range(1, rest + 1):
      if rest % expert == 0:
        out.append((data, expert, rest // expert))
  return out


def why_invalid(s: Strategy, cfg: Config) -> str | None:
  """Why `s` cannot run this model and batch (None when it can). Memory is checked by the
  cost model, which knows the device. The pipeline's rules are the config's own
  (Config.validate on the strategy applied), so the planner refuses what the trainer would."""
  m, moe = cfg.model, cfg.moe
  e, n, mm = moe.num_experts, s.expert, s.model
  for name, size in (("model.num_heads", m.num_heads), ("model.d_ff", m.d_ff),
                     ("model.num_kv_heads", m.num_kv_heads or m.num_heads),
                     ("model.vocab_size", m.vocab_size), ("moe.d_ff", moe.d_ff)):
    if size % mm:
      return f"{name}={size} not divisible by model axis {mm}"
  if why := batch_split_error(cfg.data.global_batch_size, s.data * n, "data.global_batch_size"):
    return why
  if s.expert_mode == "ep" and e % n:
    return f"ep needs E={e} divisible by expert axis {n}"
  if s.expert_mode == "fsep":
    c = s.slots(e)
    if n * c < e or c > e:
      return f"fsep needs E <= N*C and C <= E (N={n}, C={c}, E={e})"
    if moe.d_ff % (n * mm):
      return f"fsep needs moe.d_ff={moe.d_ff} divisible by expert*model={n * mm}"
  if s.dispatch not in _DISPATCH:
    return f"dispatch {s.dispatch!r} unknown"
  if s.kernels and s.kernels not in _KERNELS:
    return f"kernels {s.kernels!r} unknown"
  for name, size in m.fsdp_dims().items() if s.fsdp else ():
    if size % s.data:
      return f"fsdp needs {name}={size} divisible by data axis {s.data}"
  if s.virtual > 1 and not _schedule_fields(cfg, s.virtual):
    return f"v{s.virtual} needs the circular schedule (train.virtual_stages), not in this build"
  if why := microbatch_split_error(cfg.data.global_batch_size, s.microbatches, s.data * n):
    return why
  try:
    s.apply(cfg).validate()
  except ConfigError as err:
    return str(err).rstrip(".")
  return None


def _microbatch_options(stages: int, batch: int, shards: int) -> list[int]:
  """M for P stages: 1 without a pipeline (one program's accumulation keeps every
  microbatch's activations, so M > 1 buys nothing there); else P, 2P, 4P, 8P that split the
  batch into microbatches the data*expert devices share evenly."""
  if stages == 1:
    return [1]
  return [mb for mb in (stages, 2 * stages, 4 * stages, 8 * stages)
          if batch % mb == 0 and (batch // mb) % shards == 0]


def space(cfg: Config, num_devices: int, capacity_factors=(1.0, 1.25, 1.5, 2.0, 3.0),
          fsep_slot_options: tuple[int, ...] = (0,), dispatches=None, modes=_MODES,
          stage_options=None, virtual_options=(1,), fsdp_options=(False, True),
          kernel_options: tuple[str, ...] = ("",)) -> list[Strategy]:
  """The whole candidate space (valid or not): stages x factorizations x mode x C x factor x
  dispatch x kernels x microbatches x FSDP. fsep C = 0 means config.default_fsep_slots; other
  values are tried as given. `dispatches` None: dense, and the config's own when it is ragged
  (whose time does not depend on the factor: one factor, the config's). `kernel_options`: the
  expert kernels of dense per-slot buffers ("": the config's; pooled and ragged keep theirs).
  `stage_options` None: every P dividing the devices and the model's layer groups. FSDP only
  where data > 1."""
  if dispatches is None:
    dispatches = tuple(dict.fromkeys(("dense", cfg.moe.dispatch)))
  if stage_options is None:
    groups = num_moe_layers(cfg.model, cfg.moe)
    stage_options = [p for p in range(1, num_devices + 1)
                     if num_devices % p == 0 and groups % p == 0]
  batch = cfg.data.global_batch_size
  out = []
  for stages in stage_options:
    if num_devices % stages:
      continue
    for (data, expert, model), mode, dispatch in itertools.product(
        factorizations(num_devices // stages), modes, dispatches):
      if mode == "fsep" and expert == 1:
        continue                                     # nothing to shard experts over
      factors = (cfg.moe.capacity_factor,) if dispatch == "ragged" else capacity_factors
      slot_options = fsep_slot_options if mode == "fsep" else (0,)
      kernels = kernel_options if dispatch == "dense" and cfg.moe.capacity == "slot" else ("",)
      pipe = [(v, mb) for v in (virtual_options if stages > 1 else (1,))
              for mb in _microbatch_options(stages, batch, data * expert)]
      for cf, c, (v, mb), fsdp, kernel in itertools.product(
          factors, slot_options, pipe, [f for f in fsdp_options if data > 1 or not f], kernels):
        if mode == "fsep" and c == 0:
          c = Strategy(data, expert, model, "fsep").slots(cfg.moe.num_experts)
        out.append(Strategy(data, expert, model, mode, c, float(cf), dispatch, stages, mb, v,
                            fsdp, kernel))
  return sorted(set(out))


def check_pool(pool: list[Strategy], cfg: Config, num_devices: int) -> None:
  """Every pool member must fit the devices and the model, and all share P, V, M and FSDP
  (one-line error otherwise): a switch moves the state between members of one pipeline
  and one parameter sharding (docs/decisions/0045)."""
  if not pool:
    raise ConfigError("strategy.pool is empty; list at least one spec such as 'ep/2x4x1/cf1.25'.")
  if len(pool) > 4:
    raise ConfigError(f"strategy.pool has {len(pool)} members; keep at most 4 (each is a "
                      "compiled program held in memory).")
  for s in pool:
    if s.num_devices != num_devices:
      raise ConfigError(f"strategy {s.spec} uses {s.num_devices} devices but there are "
                        f"{num_devices}; make stages*data*expert*model = {num_devices}.")
    if _pipeline(s) != (cfg.mesh.stage, getattr(cfg.train, "virtual_stages", 1),
                        cfg.train.microbatches, cfg.mesh.fsdp):
      raise ConfigError(
          f"strategy {s.spec} has p{s.stage}/v{s.virtual}/m{s.microbatches}/fsdp={s.fsdp} but "
          f"the config has mesh.stage={cfg.mesh.stage}, train.virtual_stages="
          f"{getattr(cfg.train, 'virtual_stages', 1)}, train.microbatches="
          f"{cfg.train.microbatches}, mesh.fsdp={cfg.mesh.fsdp}; pool members share one "
          "pipeline and FSDP choice: give every spec the same and set those fields to it.")
    reason = why_invalid(s, cfg)
    if reason:
      raise ConfigError(f"strategy {s.spec} cannot run this config: {reason}.")


def _pipeline(s: Strategy) -> tuple:
  return s.stage, s.virtual, s.microbatches, s.fsdp
