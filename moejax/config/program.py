"""What the compiled program is: the mesh, the model and its MoE layers (and the rules the
trainer, the strategy space and the layer share about them)."""

from __future__ import annotations

import dataclasses
import math

from moejax.config.checks import ConfigError

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
  # Group-limited routing (DeepSeek-V3's): the experts cut into n_group groups of contiguous
  # ids; a token picks its topk_group groups by the sum of each group's two best biased
  # scores, then its top-k among their experts (1: no groups). The planners keep a group's
  # experts on its own devices (moejax.placement.groups).
  n_group: int = 1
  topk_group: int = 1
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
    self.validate_groups()

  def validate_groups(self) -> None:
    g, tg, e = self.n_group, self.topk_group, self.num_experts
    if g < 1 or not 1 <= tg <= g:
      raise ConfigError(f"moe.n_group={g}, moe.topk_group={tg}: need n_group >= 1 and topk_group "
                        "in [1, n_group] (n_group = 1: no groups).")
    if g == 1:
      return
    if e % g or e // g < 2:
      raise ConfigError(f"moe.n_group={g} must divide moe.num_experts={e} into groups of 2 or "
                        "more experts (a group scores its two best); use a divisor of "
                        f"{e} up to {e // 2}.")
    if tg * (e // g) < self.top_k:
      raise ConfigError(f"moe.topk_group={tg} groups of {e // g} experts hold fewer than "
                        f"moe.top_k={self.top_k}; use topk_group >= {-(-self.top_k // (e // g))}.")
    if self.device_limit:
      raise ConfigError(f"moe.device_limit={self.device_limit} with moe.n_group={g}: use one "
                        "limit (n_group for DeepSeek-V3's groups, device_limit for V2's devices).")


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
  # Where the MoE layer is recomputed for the backward, keep its exchanged rows (each
  # dispatch's received rows and each combine's returned rows, the exchange's outputs) instead
  # of running the exchanges and the down projection again: 2 x rows x d_model a layer more
  # memory, a third of the experts' recomputed forward less. Dense dispatch only (ragged's
  # exchange is not kept). ep: under remat (without it nothing is recomputed: no-op); fsep:
  # with or without remat, as its layer is always recomputed (moejax.model.moe.fsep_backward).
  remat_keeps_exchange: bool = False
  # "auto": the fused cuDNN kernel on GPU where it applies (bf16/fp16, head dim a multiple of
  # 8 up to 128), XLA's attention elsewhere; "xla" | "cudnn" force one (chosen at build time).
  attention: str = "auto"
  # Positions per tile of the tiled cross-entropy (moejax.train.loss): the [tokens, vocab]
  # logits are never held whole; 0: plain logits (fine for small vocabularies).
  loss_chunk: int = 0
  # Multi-head latent attention (DeepSeek-V2/V3, moejax.model.mla) when kv_lora_rank > 0:
  # keys and values expanded from one RMS-normed latent of this width per token; each head's
  # query and key a non-rotary part (qk_nope_head_dim) and a rotary one (qk_rope_head_dim,
  # the key's shared by every head); values of v_head_dim. head_dim and num_kv_heads unused.
  kv_lora_rank: int = 0
  q_lora_rank: int = 0            # MLA: the query through an RMS-normed latent this wide (0: not)
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # RoPE scaling: "none" or "yarn" (YaRN, MLA only: frequencies past rope_original_max_len
  # interpolated by rope_factor between the beta_fast and beta_slow rotations; the attention
  # scaled by the mscale terms as transformers' DeepSeek-V3 does; 0: the term is absent).
  rope_scaling: str = "none"
  rope_factor: float = 1.0
  rope_original_max_len: int = 0   # 0: max_seq_len
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_mscale: float = 0.0
  rope_mscale_all_dim: float = 0.0
  # Multi-token prediction (DeepSeek-V3, moejax.model.mtp): 1 adds a module predicting the
  # token after next from the final hidden state and the next token's embedding, its
  # cross-entropy weighted by mtp_loss_weight in the loss (0: off).
  mtp_depth: int = 0
  mtp_loss_weight: float = 0.3

  def fsdp_dims(self) -> dict[str, int]:
    """The widths FSDP splits over `data` (mesh.FSDP_RULES): d_model, and MLA's latents,
    the first dim of its per-head up-projections."""
    dims = {"model.d_model": self.d_model}
    if self.kv_lora_rank:
      dims["model.kv_lora_rank"] = self.kv_lora_rank
      if self.q_lora_rank:
        dims["model.q_lora_rank"] = self.q_lora_rank
    return dims

  def validate_latent(self) -> None:
    """MLA's widths, RoPE scaling and multi-token prediction."""
    mla = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if self.kv_lora_rank < 0 or any(getattr(self, n) < 0 for n in mla):
      raise ConfigError(f"model.kv_lora_rank={self.kv_lora_rank} and the MLA widths "
                        f"{ {n: getattr(self, n) for n in mla} } must be >= 0.")
    if self.kv_lora_rank and (min(self.qk_nope_head_dim, self.v_head_dim) < 1 or
                              self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2):
      raise ConfigError(f"model.kv_lora_rank={self.kv_lora_rank} (MLA) needs qk_nope_head_dim="
                        f"{self.qk_nope_head_dim} and v_head_dim={self.v_head_dim} >= 1 and an "
                        f"even qk_rope_head_dim={self.qk_rope_head_dim}; e.g. DeepSeek-V3's "
                        "128, 128 and 64.")
    if self.rope_scaling not in ("none", "yarn"):
      raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} is not supported; use 'none' "
                        "or 'yarn'.")
    if self.rope_scaling == "yarn" and not self.kv_lora_rank:
      raise ConfigError("model.rope_scaling='yarn' is computed by multi-head latent attention "
                        "only; set model.kv_lora_rank > 0 or model.rope_scaling = 'none'.")
    if self.rope_scaling == "yarn" and (self.rope_factor <= 0 or self.rope_original_max_len < 0):
      raise ConfigError(f"model.rope_factor={self.rope_factor} must be > 0 and model."
                        f"rope_original_max_len={self.rope_original_max_len} >= 0.")
    if self.mtp_depth not in (0, 1) or self.mtp_loss_weight < 0:
      raise ConfigError(f"model.mtp_depth={self.mtp_depth}, model.mtp_loss_weight="
                        f"{self.mtp_loss_weight}: moejax predicts one extra token (depth 0 or "
                        "1) with a weight >= 0; e.g. 1 and 0.3 (DeepSeek-V3's first phase).")

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
    self.validate_latent()
    head_dim, kv = self.head_dim or self.d_model // self.num_heads, self.num_kv_heads or 1
    bad_heads = ((not self.head_dim and self.d_model % self.num_heads) or head_dim % 2 or
                 min(self.head_dim, self.num_kv_heads) < 0 or self.num_heads % kv)
    if bad_heads and not self.kv_lora_rank:   # MLA's heads have their own widths
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
