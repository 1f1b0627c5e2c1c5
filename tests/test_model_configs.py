"""The model-family configs: every big one parses, validates and has a cost-model prediction;
each CPU miniature trains a few steps (slow: three compiles)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from moejax.config import num_moe_layers
from moejax.frontend import parse_config
from moejax.strategy.cost import PRESETS, predict_step
from moejax.strategy.offline import workload_of
from moejax.strategy.spec import Strategy

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
BIG = {"mixtral_8x7b": (32, 8, 2), "deepseek_v3": (58, 256, 8),
       "deepseek_v3_node": (15, 16, 4), "qwen3_moe": (48, 128, 8), "olmoe": (16, 64, 8)}
MINI = ("mixtral_mini", "deepseek_v3_mini", "qwen3_mini", "olmoe_mini")


@pytest.mark.parametrize("name", sorted(BIG))
def test_big_config_parses_and_is_priced(name):
  cfg = parse_config([os.path.join(CONFIGS, f"{name}.gin")], [])
  layers, experts, top_k = BIG[name]
  assert (num_moe_layers(cfg.model, cfg.moe), cfg.moe.num_experts, cfg.moe.top_k) == (
      layers, experts, top_k)
  w = workload_of(cfg)
  assert w.moe_layers == layers          # the cost model counts the dense first layers apart
  if cfg.moe.num_shared_experts:         # and prices the shared experts as dense weights
    assert w.dense_params > dataclasses.replace(w, shared_d_ff=0).dense_params
  cost = predict_step(Strategy(8, 8, 1, dispatch="ragged"), w, PRESETS["h100_cluster"])
  assert np.isfinite(cost.total_s) and cost.total_s > 0


@pytest.mark.slow   # four models compiled and trained on 8 fake devices
@pytest.mark.parametrize("name", MINI)
def test_miniature_trains(name, tmp_path):
  from moejax.train.trainer import Trainer
  cfg = parse_config([os.path.join(CONFIGS, f"{name}.gin")], [])
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(
      cfg.train, num_steps=4, run_dir=str(tmp_path / name), progress_bar=False,
      tensorboard=False, eval_every=4, eval_batches=1)).validate()
  with Trainer(cfg) as trainer:
    out = trainer.run()
  assert out["saved_step"] == 4
  assert np.isfinite(out["last"]["loss"]) and out["last"]["loss"] < out["first"]["loss"] + 0.5
  if cfg.moe.bias_rate:
    assert np.abs(np.asarray(trainer.state.router_bias_LxE)).max() > 0
