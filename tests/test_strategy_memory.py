"""The memory model's parameters + Adam moments per device against the shard shapes of the
state the trainer builds for the same strategy (shapes only: nothing compiled or allocated)."""

from __future__ import annotations

import jax
import pytest

from moejax.config import Config
from moejax.strategy.cost import PRESETS, predict_step
from moejax.strategy.offline import workload_of
from moejax.strategy.spec import parse
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import build_program
from moejax.train.state import init_state, per_device_bytes

CFG = Config()   # the default model with slot capacity: 2 layer groups, batch 16


@pytest.mark.slow   # 13-28 s per case on the loaded 2-core VM (tracing the model's init)
@pytest.mark.parametrize("spec", ["ep/2x4x1/cf1.25", "ep/2x4x1/cf1.25/fsdp",
                                  "ep/1x4x1/p2/m2/cf1.25", "ep/2x2x1/p2/m2/cf1.25/fsdp"])
def test_state_bytes_match_the_trainers_shardings(spec):
  s = parse(spec)
  tx, lr = optimizer(CFG.optim, 10), schedule(CFG.optim, 10)
  prog = build_program(CFG, s, tx, lr, jax.devices()[:8], compile_now=False)
  b, length = CFG.data.global_batch_size, CFG.data.seq_len
  shapes = jax.eval_shape(lambda: init_state(prog.model, tx, prog.shardings, prog.layout, b,
                                             length, 0))
  held = per_device_bytes((shapes.params, shapes.opt_state),
                          (prog.shardings.params, prog.shardings.opt_state))
  predicted = predict_step(s, workload_of(CFG), PRESETS["cpu"]).state_bytes
  # The model counts the weights; the trainer also holds norms' scales and optax counters.
  assert predicted == pytest.approx(held, rel=0.03), (predicted, held)


# configs/gpt_moe_gpu.gin with 4 dense first blocks (2 layer groups a stage), two stages of
# four microbatches, compiled for 8 compile-only H100s: XLA's peak 5894.2 MiB a GPU, in the
# first blocks' backward on each stage's whole batch of 32 sequences (XLA's attention scores);
# the model 5954.0 MiB (4994.0 when it divided that backward by the microbatches).
FIRST_DENSE_STAGED = ("ep/2x1x2/p2/m4/cf1.25/ragged",
                      ("moe.first_dense = 4", "moe.pallas_backend = 'triton'"))


@pytest.mark.slow   # about a minute to compile on the loaded 2-core VM
def test_staged_dense_first_blocks_within_five_percent_of_xla():
  from moejax.aot import compile_train_step, gpus
  from moejax.aot.summary import peak_bytes
  from moejax.frontend import parse_config

  if why := gpus.has_cuda_plugin():
    pytest.skip(why)
  spec, bindings = FIRST_DENSE_STAGED
  cfg, s = parse_config(["configs/gpt_moe_gpu.gin"], list(bindings)), parse(spec)
  predicted = predict_step(s, workload_of(s.apply(cfg)), PRESETS["h100_cluster"]).memory_bytes
  xla = peak_bytes(compile_train_step(cfg, s, gpu="h100", topology="1x1x8").memory)
  assert abs(predicted / xla - 1) <= 0.05, (predicted, xla)
