"""Expert placement planners: pure functions of predicted load -> Placement.

Every policy has the signature
  plan(pred_SxE, current, *, slots, src_dev_S, cost, **options) -> Placement
for one MoE layer; `pred_SxE` is the predicted (token, k) count each source
sends to each expert, built only from finished steps (see `predict`).
"""

from __future__ import annotations

import numpy as np

from moejax.config import ConfigError
from moejax.layout import placement
from moejax.placement import fsep, shadow, smartmoe
from moejax.placement.cost import CostModel


def _static(pred_SxE, current, **_):
  return placement.static(np.asarray(pred_SxE).shape[1], current.num_devices)


POLICIES = {"static": _static, "smartmoe": smartmoe.plan, "shadow": shadow.plan,
            "fsep": fsep.plan}
ONE_COPY_POLICIES = ("static", "smartmoe")


def get_policy(name: str):
  if name not in POLICIES:
    raise ConfigError(f"planner.policy={name!r} is unknown; choose one of {sorted(POLICIES)}.")
  return POLICIES[name]


def predict(history_TxLxSxE: np.ndarray, window: int) -> np.ndarray:
  """Predicted counts [L, S, E]: mean of the last `window` finished steps."""
  h = np.asarray(history_TxLxSxE, np.float64)
  if len(h) == 0 or window < 1:
    raise ValueError(f"predict needs >= 1 finished step and window >= 1 (got {len(h)}, {window})")
  return h[-window:].mean(0)


__all__ = ["POLICIES", "ONE_COPY_POLICIES", "CostModel", "get_policy", "predict", "placement"]
