"""The placement planners' cost model built from the run's config and hardware profile.

The planners weigh expert compute (the busiest device's rows) against the exchange (the rows
a device sends); both rates and the row sizes come from the run: d_model from the model,
d_ff and the dispatch from the MoE layer, the matmul and all-to-all rates from the profile
the strategy stage uses (its fitted scales included).
"""

from __future__ import annotations

from moejax.config import Config, ModelConfig, MoEConfig
from moejax.placement.layer_cost import CostModel
from moejax.strategy.cost import HardwareProfile, load_profile, runs_grouped

ACT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def placement_cost(model: ModelConfig, moe: MoEConfig, profile: HardwareProfile) -> CostModel:
  """The CostModel of one MoE layer of `model` / `moe` on `profile`'s devices."""
  return CostModel(d_model=model.d_model, d_ff=moe.d_ff,
                   flops_per_s=profile.expert_flops_per_s(runs_grouped(
                       moe.dispatch, moe.kernels, moe.capacity == "device")) /
                   profile.compute_scale,
                   link_bytes_per_s=profile.a2a_bytes_per_s / profile.comm_scale,
                   act_bytes=ACT_BYTES[model.dtype])


def of_config(cfg: Config) -> CostModel:
  """`placement_cost` with the profile the config names (`strategy.profile`)."""
  return placement_cost(cfg.model, cfg.moe, load_profile(cfg.strategy.profile))
