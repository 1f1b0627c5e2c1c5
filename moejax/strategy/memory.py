"""Device memory of a strategy, in bytes (pure arithmetic): the one memory model.

Experts, per device, for `ep` and `fsep`:
  persistent: expert parameters + the two Adam moments (all fp32), kept between steps.
  transient:  what one step adds on top: expert gradients (fp32), and in fsep three layers
              of restored slot weights and two of their gradients, in the compute dtype: the
              layer scan carries layer l's weights, restores layer l+1's and carries the
              backward restore's channel; the backward pass restores layer l-1's while it
              computes layer l's, instead of keeping the forward's copies
              (tests/test_fsep_prefetch.py checks it on XLA's memory analysis). Under FSDP the
              restores keep the weights' embed shards (moejax.model.moe.fsep_experts): those
              layers are 1/data of a layer each, and one layer is gathered whole where the MoE
              layer takes it (tests/test_fsep_fsdp.py checks it on XLA's peak). Under pipeline
              stages the backward keeps every layer's restored weights from the forward (the
              stage vmap cannot re-restore): a stage's layers are all live, under FSDP on
              the shards as with one stage (tests/test_pipeline_fsdp.py reads the restores).
`step_bytes` adds the dense parameters (with gradients and Adam moments) and the activations:
the peak the strategy cost model reports and the offline stage checks against the device.
Under P pipeline stages a device holds 1/P of the layer groups (their parameters, moments and
activations; embedding, head and dense first layers are on every stage); under FSDP every
parameter, gradient and moment is further split over the data axis (`param_shards`).
The activations at the peak (`activation_terms`) are what XLA:GPU's buffer assignment holds
there: inside one layer group's backward pass, or the loss's backward when that is larger
(decision 0099; `moejax.aot.peak_buffers` reads them from a compiled program).
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
  splits the stored weights, their moments and gradients, and the layer scan's restored slot
  weights (restored on its shards), which the MoE layer gathers one layer at a time;
  `stages` > 1: the backward keeps every layer's restored weights (on the shards under FSDP)."""
  slots = expert_slots(mode, experts, devices, slots_per_device)
  params = expert_params(mode, layers, experts, d_model, d_ff, devices, model_shards) / param_shards
  live = layers if stages > 1 else min(layers, LIVE_RESTORED_LAYERS)
  layer = slots * 3 * d_model * d_ff / model_shards if mode == "fsep" else 0   # restored, whole
  # The live restored weights and their grads; under FSDP those are 1/data of a layer each,
  # and the MoE layer computes on its layer gathered whole, counted beside them (XLA:GPU's
  # peak on 8 compile-only H100s holds the 1/data-sized buffers and up to a third of a
  # gathered layer: the model within 5% of it, tests/test_fsep_fsdp.py).
  # Under stages as well: a stage's layers, each restored on the shards, all live at once.
  restored = (2 * live * layer / param_shards + layer if param_shards > 1 else
              2 * live * layer)
  return {"mode": mode, "slots_per_device": slots,
          "persistent": 3 * params * FP32,               # params + Adam mu, nu
          "transient": params * FP32 + restored * compute_bytes}      # grads + restored


def attention_score_bytes(tokens: float, heads: int, seq_len: int, act_bytes: int,
                          model_shards: int = 1) -> float:
  """One attention layer's [B, H, Q, Q] scores on a device, when they are materialised (XLA's
  attention; cuDNN's fused kernel keeps none): the fp32 scores and the softmax in the compute
  dtype, the two residuals its backward reads (`jax.nn.dot_product_attention`'s XLA path).
  The backward of a layer holds as many again, their gradients. B*Q = `tokens`; the heads are
  split over `model`."""
  return tokens * heads * seq_len / model_shards * (FP32 + act_bytes)


def loss_bytes(tokens: float, seq_len: int, vocab_size: int, act_bytes: int,
               model_shards: int = 1, loss_chunk: int = 0) -> float:
  """The loss's working set: the whole fp32 logits and their gradient (`loss_chunk` 0), or one
  tile of `loss_chunk` positions of every sequence (moejax.train.loss.tiled_cross_entropy's
  backward: the tile's recomputed fp32 logits and their gradient in the compute dtype, the
  softmax minus the one-hot fused into that cast)."""
  if not loss_chunk or not seq_len:
    return 2 * tokens * vocab_size / model_shards * FP32
  tile = tokens / seq_len * min(loss_chunk, seq_len)
  return tile * vocab_size / model_shards * (FP32 + act_bytes)


def activation_terms(tokens: float, d_model: int, num_layers: int, vocab_size: int,
                     expert_rows: float, act_bytes: int, model_shards: int = 1, *,
                     groups: int = 0, remat: bool = False, microbatches: int = 1,
                     stretch: float = 1.0, heads: int = 0, seq_len: int = 0,
                     attention_scores: bool = False, loss_chunk: int = 0,
                     remat_blocks: bool = False, residual_width: float = 0.0,
                     first_dense: int = 0, keeps_exchange: bool = False) -> dict:
  """The activation memory of a step, in named parts: `kept` (saved by the forward pass for
  the backward, live through the whole backward pass), `work` (one layer group's backward:
  what its recomputed forward saves, and its gradients), `loss` (the loss's backward) and
  `first` (one dense first block's backward, after the groups': what it holds beside what
  the dense first blocks kept, `first_kept`, when the groups' residuals are gone).
  `work` and `loss` are live at different times; the peak holds the larger one, or the first
  blocks' backward where that is larger (`activation_bytes`).

  Per token and layer the residuals are ~20 values of width D (`residual_width`, where the
  attention's differ: multi-head latent attention's), plus 6 per expert row (summed
  over MoE layers; ragged dispatch: its fixed receive buffer's rows, `capacity.ragged_rows`).
  `num_layers`, `groups` (scanned layer groups) and `expert_rows` are this device's (a
  pipeline stage's); `first_dense` of the `num_layers` are the dense first blocks, which run
  before the groups on the device's whole batch (`tokens`), not per microbatch: with stages
  every stage runs them (moejax.model.pipeline). A pipelined step is one scan over ticks
  whose autodiff keeps every tick's residuals, idle ticks' too: `stretch` = ticks / (V*M)
  times the busy ticks'. Under `model.remat` a group keeps only its input, and one group of
  one microbatch is recomputed at a time; a dense first block checkpoints its attention and
  MLP blocks one by one and keeps their two inputs; with `remat_blocks` (fsep) every layer
  (moejax.model.transformer.LayerGroup) checkpoints the blocks before its MoE layer as one
  and keeps two compute-dtype arrays (the layer's input and the MoE layer's normed input);
  only the block being differentiated holds its recomputed attention scores;
  `keeps_exchange` (model.remat_keeps_exchange) keeps every MoE layer's two exchanged buffers
  (2 x its expert rows x D) through the backward as well. Without remat an ep layer keeps its
  6 buffers a row; an fsep one, recomputed in its own backward pass, none (2 with
  `keeps_exchange`), its recompute making them one layer at a time. With
  `attention_scores` (XLA's attention) every attention layer whose forward is live holds
  `attention_score_bytes`. With M > 1 the step also holds the embedded batch and the finished
  outputs (two [T, D] buffers)."""
  scores = attention_score_bytes(tokens, heads, seq_len, act_bytes, model_shards) if (
      attention_scores and heads and seq_len) else 0.0
  rows_per_layer = expert_rows / max(groups, 1)
  per_token = residual_width or 20 * d_model
  group_layers = num_layers - first_dense
  norms = 2 * tokens * d_model * act_bytes     # a block-remat layer's input and MoE input
  # kept exchanges: whole [rows, D] buffers on every `model` shard; a recomputed MoE layer's
  # forward then makes no new exchange buffers (4 of its 6 a row)
  exchanged = 2 * expert_rows * d_model * act_bytes * stretch if keeps_exchange else 0.0
  buffers = 4 if keeps_exchange else 6
  if remat and groups:
    layers_per_group = group_layers / groups
    if remat_blocks:
      kept = groups * layers_per_group * norms * stretch
      live_scores = 1
    else:
      kept = tokens * d_model * groups * stretch * act_bytes  # group inputs: not split over `model`
      live_scores = layers_per_group
    kept += exchanged
    work = ((per_token * tokens * layers_per_group + buffers * rows_per_layer * d_model) *
            act_bytes / model_shards + (live_scores + 1) * scores) / microbatches
    first_kept = first_dense * 2 * tokens * d_model * act_bytes   # its blocks' two inputs
    first = per_token * tokens * act_bytes / model_shards + 2 * scores
  else:
    # fsep's MoE layer (`remat_blocks`) is recomputed in its own backward pass whatever remat
    # says (moejax.model.moe.fsep_backward): the forward keeps none of its buffers but the
    # exchanged ones, and its recompute makes the rest, one layer at a time
    kept = ((per_token * tokens * group_layers + (0 if remat_blocks else 6) * expert_rows *
             d_model) * act_bytes / model_shards + group_layers * scores) * stretch
    work = scores / microbatches
    if remat_blocks:
      kept += exchanged
      work += buffers * rows_per_layer * d_model * act_bytes / model_shards / microbatches
    first_kept = first_dense * (per_token * tokens * act_bytes / model_shards + scores)
    first = scores
  kept += first_kept
  if microbatches > 1:
    kept += 2 * tokens * d_model * act_bytes
  return {"kept": kept, "work": work,
          "loss": loss_bytes(tokens, seq_len, vocab_size, act_bytes, model_shards, loss_chunk),
          "first_kept": first_kept, "first": first if first_dense else 0.0}


def activation_bytes(*args, **kwargs) -> float:
  """The activations at the step's peak: what the forward keeps, and the larger of one
  group's backward and the loss's backward; or, where larger, a dense first block's backward
  beside what the first blocks keep (`activation_terms`, same arguments)."""
  t = activation_terms(*args, **kwargs)
  return max(t["kept"] + max(t["work"], t["loss"]), t["first_kept"] + t["first"])


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
