"""Device memory of a strategy, in bytes (pure arithmetic): the one memory model.

Experts, per device, for `ep` and `fsep`:
  persistent: expert parameters + the two Adam moments (all fp32), kept between steps.
  transient:  what one step adds on top: expert gradients (fp32), and in fsep three layers
              of restored slot weights and two of their gradients, in the compute dtype: the
              layer scan carries layer l's weights, restores layer l+1's and carries the
              backward restore's channel; the backward pass restores layer l-1's while it
              computes layer l's, instead of keeping the forward's copies
              (tests/test_fsep_prefetch.py checks it on XLA's memory analysis). Under pipeline
              stages the backward keeps every layer's restored weights from the forward (the
              stage vmap cannot re-restore): a stage's layers are all live.
`step_bytes` adds the dense parameters (with gradients and Adam moments) and the activations:
the peak the strategy cost model reports and the offline stage checks against the device.
Under P pipeline stages a device holds 1/P of the layer groups (their parameters, moments and
activations; embedding, head and dense first layers are on every stage); under FSDP every
parameter, gradient and moment is further split over the data axis (`param_shards`).
The trainer writes `report` into the run dir; `python -m moejax.replay ... --d_model D --d_ff F
--layers L` prints it beside the planner results.
"""

from __future__ import annotations

from moejax.config import default_fsep_slots

FP32 = 4
MODES = ("ep", "fsep")
LIVE_RESTORED_LAYERS = 3     # fsep: the layer computing, the next one's, the backward channel


def expert_slots(mode: str, experts: int, devices: int, slots_per_device: int | None = None) -> int:
  """C: expert slots a device computes (ep: its E/N experts; fsep: the restored slots)."""
  if mode == "ep":
    return experts // devices
  if mode == "fsep":
    return slots_per_device or default_fsep_slots(experts, devices)
  raise ValueError(f"mode={mode!r}: use one of {MODES}")


def expert_params(mode: str, layers: int, experts: int, d_model: int, d_ff: int, devices: int,
                  model_shards: int = 1) -> float:
  """Expert parameters a device keeps between steps: ep its E/N whole experts, fsep 1/N of
  every expert; `devices` = N (expert axis), `model_shards` = M."""
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: use one of {MODES}")
  per_device = experts // devices if mode == "ep" else experts / devices
  return per_device * layers * 3 * d_model * d_ff / model_shards     # w_gate, w_up, w_down


def expert_bytes(mode: str, layers: int, experts: int, d_model: int, d_ff: int, devices: int,
                 model_shards: int = 1, slots_per_device: int | None = None,
                 compute_bytes: int = FP32, param_shards: int = 1, stages: int = 1) -> dict:
  """Per-device expert bytes; `devices` = N (expert axis), `model_shards` = M, `layers` the
  MoE layers this device holds (all of them, or a pipeline stage's); `compute_bytes`: bytes
  per element of the compute dtype (`model.dtype`); `param_shards`: FSDP's data axis, which
  splits the stored weights, their moments and gradients but not the restored slot weights;
  `stages` > 1: the backward keeps every layer's restored weights."""
  slots = expert_slots(mode, experts, devices, slots_per_device)
  params = expert_params(mode, layers, experts, d_model, d_ff, devices, model_shards) / param_shards
  live = layers if stages > 1 else min(layers, LIVE_RESTORED_LAYERS)
  restored = live * slots * 3 * d_model * d_ff / model_shards if mode == "fsep" else 0
  return {"mode": mode, "slots_per_device": slots,
          "persistent": 3 * params * FP32,               # params + Adam mu, nu
          # grads (+ the live restored weights and their grads)
          "transient": params * FP32 + 2 * restored * compute_bytes}


def activation_bytes(tokens: float, d_model: int, num_layers: int, vocab_size: int,
                     expert_rows: float, act_bytes: int, model_shards: int = 1, *,
                     groups: int = 0, remat: bool = False, microbatches: int = 1,
                     stretch: float = 1.0) -> float:
  """Activations kept for the backward pass: per token and layer, plus the expert rows (summed
  over MoE layers) and the fp32 logits with their gradient. `num_layers`, `groups` (scanned
  layer groups) and `expert_rows` are this device's (a pipeline stage's). A pipelined step is
  one scan over ticks whose autodiff keeps every tick's residuals, idle ticks' too: `stretch`
  = ticks / (V*M) times the busy ticks'. Under `model.remat` a group keeps only its input,
  and one group of one microbatch is recomputed at a time. With M > 1 the step also holds
  the embedded batch and the finished outputs (two [T, D] buffers)."""
  rows_per_layer = expert_rows / max(groups, 1)
  if remat and groups:
    kept = tokens * d_model * groups * stretch     # group inputs: not split over `model`
    layers_per_group = num_layers / groups
    work = (20 * tokens * d_model * layers_per_group + 6 * rows_per_layer * d_model) / (
        microbatches * model_shards)
    layers_b = (kept + work) * act_bytes
  else:
    layers_b = ((20 * tokens * d_model * num_layers + 6 * expert_rows * d_model) * stretch *
                act_bytes / model_shards)
  buffers = 2 * tokens * d_model * act_bytes if microbatches > 1 else 0.0
  return layers_b + buffers + 2 * tokens * vocab_size / model_shards * FP32


def step_bytes(dense_params: float, experts: dict, activations: float) -> float:
  """Peak bytes of a step on one device: `dense_params` (per device) with their gradients and
  two Adam moments in fp32, the `expert_bytes` of the mode, and the activations."""
  return 4 * FP32 * dense_params + experts["persistent"] + experts["transient"] + activations


def report(layers: int, experts: int, d_model: int, d_ff: int, devices: int,
           model_shards: int = 1, fsep_slots: int | None = None,
           compute_bytes: int = FP32) -> str:
  rows = [f"expert memory per device (layers={layers}, E={experts}, d_model={d_model}, "
          f"d_ff={d_ff}, N={devices}, M={model_shards}):"]
  for mode in MODES:
    if mode == "ep" and experts % devices:
      rows.append("  ep   n/a (E not divisible by N)")
      continue
    b = expert_bytes(mode, layers, experts, d_model, d_ff, devices, model_shards, fsep_slots,
                     compute_bytes)
    rows.append(f"  {mode:<4} C={b['slots_per_device']:<3} persistent "
                f"{b['persistent'] / 2**20:9.2f} MiB   transient {b['transient'] / 2**20:9.2f} MiB")
  return "\n".join(rows)
