"""Expert memory per device for `ep` and `fsep`, in bytes (pure arithmetic).

persistent: expert parameters + the two Adam moments (all fp32), kept between steps.
transient:  what one step adds on top: expert gradients, and in fsep the restored
            slot weights of every MoE layer and their gradients (all layers' restores
            are issued before the layer scan so they can overlap compute).
The trainer writes this table into the run dir; `python -m moejax.replay ... --d_model D
--d_ff F --layers L` prints it beside the planner results.
"""

from __future__ import annotations

FP32 = 4


def expert_bytes(mode: str, layers: int, experts: int, d_model: int, d_ff: int, devices: int,
                 model_shards: int = 1, slots_per_device: int | None = None) -> dict:
  """Per-device expert bytes; `devices` = N (expert axis), `model_shards` = M."""
  per_expert = 3 * d_model * d_ff                  # w_gate, w_up, w_down
  if mode == "ep":
    slots = experts // devices
    params = layers * slots * per_expert // model_shards
    restored = 0
  elif mode == "fsep":
    slots = slots_per_device or min(experts, 2 * -(-experts // devices))
    params = layers * experts * per_expert // (devices * model_shards)
    restored = layers * slots * per_expert // model_shards
  else:
    raise ValueError(f"mode={mode!r}: use 'ep' or 'fsep'")
  return {"mode": mode, "slots_per_device": slots,
          "persistent": 3 * params * FP32,               # params + Adam mu, nu
          "transient": (params + 2 * restored) * FP32}   # grads (+ restored weights, grads)


def report(layers: int, experts: int, d_model: int, d_ff: int, devices: int,
           model_shards: int = 1, fsep_slots: int | None = None) -> str:
  rows = [f"expert memory per device (layers={layers}, E={experts}, d_model={d_model}, "
          f"d_ff={d_ff}, N={devices}, M={model_shards}):"]
  for mode in ("ep", "fsep"):
    if mode == "ep" and experts % devices:
      rows.append("  ep   n/a (E not divisible by N)")
      continue
    b = expert_bytes(mode, layers, experts, d_model, d_ff, devices, model_shards, fsep_slots)
    rows.append(f"  {mode:<4} C={b['slots_per_device']:<3} persistent "
                f"{b['persistent'] / 2**20:9.2f} MiB   transient {b['transient'] / 2**20:9.2f} MiB")
  return "\n".join(rows)
