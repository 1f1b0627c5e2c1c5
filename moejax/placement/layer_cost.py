"""The per-layer cost model placement policies decide by.

Expert compute follows the busiest device (max, not mean), token exchange follows the bytes a
device sends, and moving or replicating an expert costs its weight bytes. Every field is the
run's own: `moejax.strategy.placement_cost.of_config` builds it from the model, the MoE layer
and the hardware profile, so the trade between compute and exchange is the program's.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CostModel:
  d_model: int
  d_ff: int                            # expert hidden size
  flops_per_s: float                   # expert matmuls, sustained per device
  link_bytes_per_s: float              # per device, all-to-all
  act_bytes: int                       # activation element size in the exchange
  bytes_per_param: int = 4             # parameters are float32

  @property
  def expert_params(self) -> int:
    return 3 * self.d_model * self.d_ff

  def row_bytes(self) -> int:
    """Bytes of one (token, k) row in the exchange."""
    return self.d_model * self.act_bytes

  def compute_s(self, tokens: float) -> float:
    """fwd + bwd of `tokens` (token, k) rows through one SwiGLU expert (6 flops/param/row)."""
    return 6.0 * self.expert_params * tokens / self.flops_per_s

  def exchange_s(self, tokens_sent: float) -> float:
    """Dispatch + combine, fwd + bwd: 4 transfers of a d_model row."""
    return 4.0 * tokens_sent * self.row_bytes() / self.link_bytes_per_s

  def expert_move_bytes(self, experts: int) -> int:
    """Bytes of `experts` experts' weights and, for ep migration, their Adam state: x3."""
    return 3 * experts * self.expert_params * self.bytes_per_param

  def expert_move_s(self, experts: int) -> float:
    """Move `experts` experts (`expert_move_bytes`) over one link."""
    return self.expert_move_bytes(experts) / self.link_bytes_per_s

  def replica_sync_s(self, replicas: float) -> float:
    """Broadcast a replica's weights and reduce its gradient, every step."""
    return 2.0 * replicas * self.expert_params * self.bytes_per_param / self.link_bytes_per_s

  def step_s(self, device_load_N: np.ndarray, sent_by_device_N: np.ndarray,
             replicas_per_device: float = 0.0) -> float:
    return (self.compute_s(float(np.max(device_load_N))) +
            self.exchange_s(float(np.max(sent_by_device_N))) +
            self.replica_sync_s(replicas_per_device))
