"""Expert placement policies: pure functions of predicted load -> Placement.

Every policy is called as
  policy(pred_WxE, current, *, slots, src_dev_W, cost, num_devices, options,
         samples_stepsxWxE=None) -> Placement
for one MoE layer; `pred_WxE` is the predicted (token, k) count each source sends to each
expert, built only from finished steps (see `predict`); `samples_stepsxWxE`, when given, the
finished steps it averages, for a policy that scores drops step by step. A policy uses what
it needs of the shared keywords; `options` is its own frozen dataclass (`make_options` builds
it by name and rejects an option the policy does not have).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import ConfigError
from moejax.layout import host_layout as placement_lib
from moejax.placement import fsep, shadow, smartmoe
from moejax.placement.layer_cost import CostModel


@dataclasses.dataclass(frozen=True)
class StaticOptions:
  """The static layout has no options."""


def place_static(pred_WxE: np.ndarray, current: placement_lib.Placement, *,
                 slots: int | None = None, src_dev_W: np.ndarray | None = None,
                 cost: CostModel | None = None, num_devices: int | None = None,
                 options: StaticOptions = StaticOptions(),
                 samples_stepsxWxE: np.ndarray | None = None) -> placement_lib.Placement:
  """Expert e on device e // (E/N), whatever the load."""
  del samples_stepsxWxE
  return placement_lib.static(np.asarray(pred_WxE).shape[1], current.num_devices)


POLICIES = {"static": place_static, "smartmoe": smartmoe.place_permutation,
            "shadow": shadow.place_shadows, "fsep": fsep.place_replicas}
OPTIONS = {"static": StaticOptions, "smartmoe": smartmoe.SmartMoEOptions,
           "shadow": shadow.ShadowOptions, "fsep": fsep.FsepOptions}
ONE_COPY_POLICIES = ("static", "smartmoe")


def get_policy(name: str):
  if name not in POLICIES:
    raise ConfigError(f"planner.policy={name!r} is unknown; choose one of {sorted(POLICIES)}.")
  return POLICIES[name]


def make_options(name: str, **given):
  """Policy `name`'s options dataclass from keyword values; a one-line ConfigError names an
  option the policy does not have and the ones it has."""
  get_policy(name)
  cls = OPTIONS[name]
  valid = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(given) - set(valid))
  if unknown:
    raise ConfigError(f"policy {name!r} has no option {', '.join(map(repr, unknown))}; its "
                      f"options are: {', '.join(valid) or 'none'}.")
  return cls(**given)


class Steps(list):
  """A window's finished steps of one layer, oldest first, as a list of [W, E] arrays (not
  stacked: that would copy the whole window for every decision); `totals_stepsxE`, each
  step's expert totals over the sources (`fsep.spread.step_totals`), where the caller kept
  them as the steps came, else None."""

  def __init__(self, steps=(), totals_stepsxE: np.ndarray | None = None):
    super().__init__(steps)
    self.totals_stepsxE = totals_stepsxE


def predict(history_stepsxLxWxE: np.ndarray, window: int) -> np.ndarray:
  """Predicted counts [L, W, E]: mean of the last `window` finished steps."""
  h = np.asarray(history_stepsxLxWxE, np.float64)
  if len(h) == 0 or window < 1:
    raise ValueError(f"predict needs >= 1 finished step and window >= 1 (got {len(h)}, {window})")
  return h[-window:].mean(0)


__all__ = ["POLICIES", "OPTIONS", "ONE_COPY_POLICIES", "CostModel", "get_policy",
           "make_options", "predict", "place_static", "Steps"]
