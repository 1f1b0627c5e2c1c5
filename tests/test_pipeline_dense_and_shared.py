"""Shared experts and dense first layers under pipeline stages equal one device.

The shared experts are a dense SwiGLU inside each layer group (moejax.model.transformer's
LayerGroup), so their weights carry the `layers` axis, are sharded over `stage` with the rest
of the group and run on the stage that holds it: nothing in the pipeline names them. The dense
first layers (`moe.first_dense`) sit before the groups; the pipeline applies them like the
embedding, on every stage. These cases check both (P = 2 x expert 4) with tests/moe_helpers.py's
check_pipeline. Each compiles a pipelined program for minutes on the 2-core VM, hence `slow`.
"""

from __future__ import annotations

import dataclasses

import pytest

from moejax.config import Config, ConfigError, MeshConfig, ModelConfig, MoEConfig, TrainConfig
from tests.moe_helpers import SMALL_MODEL, SMALL_MOE, check_pipeline

# shared_d_ff 8, not 16: a [16, 32] weight gradient would have a microbatch's per-device
# shape (16 positions x d_model 32), and check_pipeline counts sends by shape.
SHARED = dataclasses.replace(SMALL_MOE, num_shared_experts=1, shared_d_ff=8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ep", "fsep"])
def test_shared_experts_p2_e4_match_one_device(mode):
  check_pipeline(SMALL_MODEL, dataclasses.replace(SHARED, expert_mode=mode), (1, 4, 1),
                 stages=2, micro=2)


@pytest.mark.slow
def test_dense_first_layer_p2_e4_matches_one_device():
  check_pipeline(dataclasses.replace(SMALL_MODEL, num_layers=3),
                 dataclasses.replace(SMALL_MOE, first_dense=1), (1, 4, 1), stages=2, micro=2)


def test_stages_take_shared_experts_and_dense_first_layers():
  piped = dict(mesh=MeshConfig(stage=2), train=TrainConfig(microbatches=2))
  Config(moe=MoEConfig(num_shared_experts=1), **piped).validate()
  # two layer groups after the two dense layers
  Config(model=ModelConfig(num_layers=6), moe=MoEConfig(num_shared_experts=1, first_dense=2),
         **piped).validate()
  with pytest.raises(ConfigError) as e:     # one group after four dense layers: not 2 stages
    Config(model=ModelConfig(num_layers=6), moe=MoEConfig(first_dense=4), **piped).validate()
  msg = str(e.value)
  assert "\n" not in msg and "mesh.stage=2" in msg, msg
