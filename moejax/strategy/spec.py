"""Strategies: the static shape of one compiled train step, and the space of them.

A strategy fixes what the compiler must know: the mesh factorization (data x
expert x model; the data axis doubles as the expert-data-parallel group, i.e. each
expert is replicated over `data`), the expert mode (`ep` / `fsep`), the slots per
device C, the capacity factor and the dispatch kind. One strategy = one compiled
program; the layout inside it stays data. JAX-free, so planners and the offline
search are plain Python.

A strategy is written as a short spec, e.g. `ep/2x4x1/cf1.25` or
`fsep/1x8x1/c2/cf1.25[/ragged]`.
"""

from __future__ import annotations

import dataclasses
import itertools

from moejax.config import Config, ConfigError, batch_split_error, default_fsep_slots

_MODES = ("ep", "fsep")
_DISPATCH = ("dense", "ragged")


@dataclasses.dataclass(frozen=True, order=True)
class Strategy:
  data: int
  expert: int
  model: int
  expert_mode: str = "ep"
  slots_per_device: int = 0        # fsep C (0 = moejax default); ep always E/N
  capacity_factor: float = 1.25
  dispatch: str = "dense"

  @property
  def num_devices(self) -> int:
    return self.data * self.expert * self.model

  def slots(self, num_experts: int) -> int:
    """C: slots each expert-axis device hosts."""
    if self.expert_mode == "ep":
      return max(1, num_experts // self.expert)
    return self.slots_per_device or default_fsep_slots(num_experts, self.expert)

  @property
  def spec(self) -> str:
    parts = [self.expert_mode, f"{self.data}x{self.expert}x{self.model}"]
    if self.expert_mode == "fsep":
      parts.append(f"c{self.slots_per_device}")
    parts.append(f"cf{self.capacity_factor:g}")
    if self.dispatch != "dense":
      parts.append(self.dispatch)
    return "/".join(parts)

  def __str__(self) -> str:
    return self.spec

  def apply(self, cfg: Config) -> Config:
    """`cfg` with this strategy's mesh and MoE fields; the planner policy follows the mode
    (a non-static policy becomes the mode's own re-planner)."""
    mesh = dataclasses.replace(cfg.mesh, data=self.data, expert=self.expert, model=self.model)
    moe = dataclasses.replace(cfg.moe, expert_mode=self.expert_mode,
                              slots_per_device=self.slots_per_device if
                              self.expert_mode == "fsep" else 0,
                              capacity_factor=self.capacity_factor, dispatch=self.dispatch)
    policy = cfg.planner.policy
    if policy != "static":
      policy = "smartmoe" if self.expert_mode == "ep" else "fsep"
    planner = dataclasses.replace(cfg.planner, policy=policy)
    return dataclasses.replace(cfg, mesh=mesh, moe=moe, planner=planner)


def parse(spec: str) -> Strategy:
  """`ep/2x4x1/cf1.25`, `fsep/1x8x1/c2/cf1.5/ragged` -> Strategy (one-line errors)."""
  example = "e.g. 'ep/2x4x1/cf1.25' or 'fsep/1x8x1/c2/cf1.25'"
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
      elif part.startswith("cf"):
        fields["capacity_factor"] = float(part[2:])
      elif part.startswith("c"):
        fields["slots_per_device"] = int(part[1:])
      else:
        raise ValueError
    except ValueError:
      raise ConfigError(f"strategy {spec!r}: unknown part {part!r}; {example}.") from None
  if min(data, expert, model) < 1:
    raise ConfigError(f"strategy {spec!r}: mesh sizes must be >= 1; {example}.")
  return Strategy(data, expert, model, **fields)


def from_config(cfg: Config, num_devices: int) -> Strategy:
  """The strategy a config describes (mesh -1 resolved against `num_devices`)."""
  sizes = cfg.mesh.resolve(num_devices)
  slots = cfg.moe.slots_per_device if cfg.moe.expert_mode == "fsep" else 0
  return Strategy(*sizes, expert_mode=cfg.moe.expert_mode, slots_per_device=slots,
                  capacity_factor=cfg.moe.capacity_factor, dispatch=cfg.moe.dispatch)


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
  cost model, which knows the device."""
  m, moe = cfg.model, cfg.moe
  e, n, mm = moe.num_experts, s.expert, s.model
  for name, size in (("model.num_heads", m.num_heads), ("model.d_ff", m.d_ff),
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
  return None


def space(cfg: Config, num_devices: int, capacity_factors=(1.0, 1.25, 1.5, 2.0, 3.0),
          fsep_slot_options: tuple[int, ...] = (0,), dispatches=("dense",),
          modes=_MODES) -> list[Strategy]:
  """The whole candidate space (valid or not): factorizations x mode x C x factor x dispatch.
  fsep C = 0 means config.default_fsep_slots; other values are tried as given."""
  out = []
  for (data, expert, model), mode, cf, dispatch in itertools.product(
      factorizations(num_devices), modes, capacity_factors, dispatches):
    if mode == "fsep" and expert == 1:
      continue                                     # nothing to shard experts over
    slot_options = fsep_slot_options if mode == "fsep" else (0,)
    for c in slot_options:
      if mode == "fsep" and c == 0:
        c = Strategy(data, expert, model, "fsep").slots(cfg.moe.num_experts)
      out.append(Strategy(data, expert, model, mode, c, float(cf), dispatch))
  return sorted(set(out))


def check_pool(pool: list[Strategy], cfg: Config, num_devices: int) -> None:
  """Every pool member must fit the devices and the model (one-line error otherwise)."""
  if not pool:
    raise ConfigError("strategy.pool is empty; list at least one spec such as 'ep/2x4x1/cf1.25'.")
  if len(pool) > 4:
    raise ConfigError(f"strategy.pool has {len(pool)} members; keep at most 4 (each is a "
                      "compiled program held in memory).")
  for s in pool:
    if s.num_devices != num_devices:
      raise ConfigError(f"strategy {s.spec} uses {s.num_devices} devices but there are "
                        f"{num_devices}; make data*expert*model = {num_devices}.")
    reason = why_invalid(s, cfg)
    if reason:
      raise ConfigError(f"strategy {s.spec} cannot run this config: {reason}.")
