"""mesh.stage, mesh.fsdp and train.microbatches: one-line errors and the parameter rules."""

from __future__ import annotations

import numpy as np
import pytest

from moejax.config import (
  Config,
  ConfigError,
  DataConfig,
  MeshConfig,
  ModelConfig,
  MoEConfig,
  TrainConfig,
  microbatch_split_error,
)
from moejax.model import layer_order
from moejax.model.mesh import RULES, param_rules


def assert_one_line(excinfo, *needles: str) -> None:
  msg = str(excinfo.value)
  assert msg and "\n" not in msg and msg == msg.strip(), repr(msg)
  for needle in needles:
    assert needle in msg, f"{needle!r} not in {msg!r}"


def test_layer_groups_not_divisible_by_stages():
  cfg = Config(mesh=MeshConfig(stage=2), model=ModelConfig(num_layers=6))
  with pytest.raises(ConfigError) as e:
    cfg.validate()
  assert_one_line(e, "model.num_layers=6", "3 layer groups", "mesh.stage=2")


def test_microbatches_not_dividing_the_batch():
  cfg = Config(data=DataConfig(global_batch_size=16), train=TrainConfig(microbatches=3))
  with pytest.raises(ConfigError) as e:
    cfg.validate()
  assert_one_line(e, "train.microbatches=3", "global_batch_size=16", "divisor of 16")


def test_microbatch_rows_not_splitting_over_the_devices():
  msg = microbatch_split_error(16, 4, 8)
  assert "train.microbatches=4" in msg and "4 rows" in msg and "multiple of 32" in msg
  assert microbatch_split_error(16, 2, 8) is None


@pytest.mark.parametrize("mesh, needles", [
    (MeshConfig(data=2, expert=4, stage=2), ("multiply to 8", "4 devices per stage",
                                             "mesh.stage=2")),
    (MeshConfig(data=-1, expert=4, stage=3), ("mesh.stage=3", "divisor of 8")),
    (MeshConfig(stage=0), ("mesh.stage=0",)),
])
def test_mesh_product_with_stages(mesh, needles):
  with pytest.raises(ConfigError) as e:
    mesh.resolve(8)
  assert_one_line(e, *needles)


def test_stages_resolve_the_rest_per_stage():
  assert MeshConfig(data=-1, expert=2, stage=2).resolve(8) == (2, 2, 1)


@pytest.mark.parametrize("moe", [MoEConfig(expert_mode="fsep"), MoEConfig(capacity="device")],
                         ids=["fsep", "pooled"])
def test_stages_run_fsep_and_pooled_capacity(moe):
  """Refused until moejax.model.pipeline ran them (tests/test_pipeline_schedules.py)."""
  Config(mesh=MeshConfig(stage=2), moe=moe, train=TrainConfig(microbatches=2)).validate()


@pytest.mark.parametrize("train, needles", [
    (TrainConfig(pipeline_schedule="circular"), ("'circular'", "virtual_stages=1", "2 or more")),
    (TrainConfig(virtual_stages=2), ("'gpipe'", "virtual_stages=2", "'circular' with 2")),
    (TrainConfig(virtual_stages=0), ("virtual_stages=0", "'gpipe' with 1")),
    (TrainConfig(pipeline_schedule="1f1b"), ("pipeline_schedule='1f1b'",)),
    (TrainConfig(pipeline_schedule="circular", virtual_stages=2, microbatches=1),
     ("microbatches=1", ">= mesh.stage=2", "train.microbatches = 2")),
    (TrainConfig(pipeline_schedule="circular", virtual_stages=4, microbatches=2),
     ("4 layer groups", "mesh.stage=2 x train.virtual_stages=4", "model.num_layers = 16")),
])
def test_circular_schedule_errors(train, needles):
  cfg = Config(mesh=MeshConfig(stage=2), model=ModelConfig(num_layers=8), train=train)
  with pytest.raises(ConfigError) as e:
    cfg.validate()
  assert_one_line(e, *needles)


def test_circular_schedule_validates():
  Config(mesh=MeshConfig(stage=2), model=ModelConfig(num_layers=8), train=TrainConfig(
      pipeline_schedule="circular", virtual_stages=2, microbatches=2)).validate()


def test_storage_order_puts_a_stages_chunks_together():
  """P=2, V=2, 8 groups: chunk c = r*P + s holds groups 2c, 2c + 1; stage 0 (storage rows
  0-3) holds chunks 0 and 2, stage 1 chunks 1 and 3. V = 1 stores the canonical order."""
  order = layer_order.storage_order(8, 2, 2)
  np.testing.assert_array_equal(order, [0, 1, 4, 5, 2, 3, 6, 7])
  np.testing.assert_array_equal(order[layer_order.inverse(order)], np.arange(8))
  assert layer_order.is_identity(layer_order.storage_order(8, 4, 1))
  np.testing.assert_array_equal(layer_order.storage_order(6, 1, 3), np.arange(6))
  with pytest.raises(ConfigError) as e:
    layer_order.storage_order(6, 2, 2)
  assert_one_line(e, "6 layer groups", "mesh.stage=2", "virtual_stages=2")


def test_reorder_state_moves_layer_leaves_and_their_moments_only():
  order = layer_order.storage_order(4, 2, 2)
  tree = {"params": {"layers": {"w": np.arange(4)}, "embed": np.arange(4)},
          "opt": ({"mu": {"fsep_experts": {"w": np.arange(4) * 10}, "embed": np.arange(4)}},),
          "router_bias_LxE": np.arange(4)}
  out = layer_order.reorder_state(tree, order)
  np.testing.assert_array_equal(out["params"]["layers"]["w"], [0, 2, 1, 3])
  np.testing.assert_array_equal(out["opt"][0]["mu"]["fsep_experts"]["w"], [0, 20, 10, 30])
  for same in (out["params"]["embed"], out["opt"][0]["mu"]["embed"], out["router_bias_LxE"]):
    np.testing.assert_array_equal(same, np.arange(4))
  back = layer_order.reorder_state(out, layer_order.inverse(order))
  np.testing.assert_array_equal(back["params"]["layers"]["w"], np.arange(4))


def test_param_rules_override_only_embed_latent_and_layers():
  assert param_rules() == RULES
  both = dict(param_rules(fsdp=True, stage=True))
  assert both["embed"] == both["latent"] == "data" and both["layers"] == "stage"
  overridden = ("embed", "latent", "layers")
  assert {k: v for k, v in both.items() if k not in overridden} == {
      k: v for k, v in RULES if k not in overridden}
