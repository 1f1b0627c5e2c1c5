"""mesh.stage, mesh.fsdp and train.microbatches: one-line errors and the parameter rules."""

from __future__ import annotations

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


def test_stages_need_ep():
  cfg = Config(mesh=MeshConfig(stage=2), moe=MoEConfig(expert_mode="fsep", top_k=2))
  with pytest.raises(ConfigError) as e:
    cfg.validate()
  assert_one_line(e, "mesh.stage=2", "expert_mode='ep'")


def test_stages_need_slot_capacity():
  cfg = Config(mesh=MeshConfig(stage=2), moe=MoEConfig(capacity="device"))
  with pytest.raises(ConfigError) as e:
    cfg.validate()
  assert_one_line(e, "mesh.stage=2", "moe.capacity='slot'")


def test_param_rules_override_only_embed_and_layers():
  assert param_rules() == RULES
  both = dict(param_rules(fsdp=True, stage=True))
  assert both["embed"] == "data" and both["layers"] == "stage"
  assert {k: v for k, v in both.items() if k not in ("embed", "layers")} == {
      k: v for k, v in RULES if k not in ("embed", "layers")}
