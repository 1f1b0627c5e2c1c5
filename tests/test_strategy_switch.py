"""Switching among compiled strategies: nothing compiles after warm-up, a round trip gives
the identical state, and training goes on with the same losses (CPU mesh, tiny model)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import Config, DataConfig, ModelConfig, MoEConfig, OptimConfig
from moejax.layout.tables import from_slot_expert
from moejax.strategy.spec import parse
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import CompileCounter, Transfer, build_program
from moejax.train.state import init_state

CFG = Config(model=ModelConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_seq_len=16),
             moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=4.0, d_ff=32, moe_every=2),
             data=DataConfig(seq_len=16, global_batch_size=8),
             optim=OptimConfig(learning_rate=1e-2, warmup_steps=1))
POOL = ["ep/2x4x1/cf4", "ep/1x8x1/cf4", "fsep/1x8x1/c2/cf4"]


TX = optimizer(CFG.optim, 10)


@pytest.fixture(scope="module")
def pool():
  """The compiled programs and every ordered transfer, built once (the expensive part)."""
  tx, lr = TX, schedule(CFG.optim, 10)
  progs = [build_program(CFG, parse(s), tx, lr) for s in POOL]
  # A non-trivial ep placement on the first member, so canonical order really matters.
  perm = np.random.default_rng(0).permutation(8)
  progs[0].layout = jax.device_put(from_slot_expert(perm[None], 8), progs[0].layout_sharding)
  moves = {(a, b): Transfer(progs[a], progs[b], tx)
           for a, b in itertools.permutations(range(len(progs)), 2)}
  return progs, moves


def _init(prog):
  return init_state(prog.model, TX, prog.shardings, prog.layout, 8, 16, 0)


def _batches(n):
  rng = np.random.default_rng(1)
  return [rng.integers(0, 256, (8, 17)).astype(np.int32) for _ in range(n)]


def _step(prog, state, rows):
  batch = jax.device_put(rows, prog.batch_sharding)
  return prog.train_step(state, batch, prog.layout)


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _assert_identical(a, b):
  """Same structure and bitwise-equal leaves."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_switching_compiles_nothing_and_round_trip_is_identical(pool):
  progs, moves = pool
  state = _init(progs[0])
  rows = _batches(8)
  state, m0 = _step(progs[0], state, rows[0])            # warm-up: programs + moves compiled
  before = _host(state)
  layout_before = _host(progs[0].layout)
  with CompileCounter() as compiles:
    back = moves[(1, 0)](moves[(0, 1)](state))            # ep 2x4 -> ep 1x8 -> ep 2x4
    _assert_identical(_host(back), before)
    back = moves[(2, 0)](moves[(0, 2)](back))             # ep -> fsep -> ep
    _assert_identical(_host(back), before)
    _assert_identical(_host(progs[0].layout), layout_before)
    cur, s = 0, back
    for i, nxt in enumerate([1, 2, 0, 2, 1, 0, 1]):       # every member, several times
      s = moves[(cur, nxt)](s)
      cur = nxt
      s, m = _step(progs[cur], s, rows[1 + i])
      assert np.isfinite(float(m["loss"]))
  assert compiles.count == 0, f"{compiles.count} compilations after warm-up"


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_training_continues_with_the_same_losses(pool):
  progs, moves = pool
  rows = _batches(6)
  ref, losses_ref = _init(progs[0]), []
  for r in rows:
    ref, m = _step(progs[0], ref, r)
    losses_ref.append(float(m["loss"]))
  # Fresh state (the first run donated it): same init, switching every step 0 -> 2 -> 1 -> 0.
  state = _init(progs[0])
  order, cur, losses = [0, 2, 1, 0, 2, 0], 0, []
  for member, r in zip(order, rows):
    if member != cur:
      state, cur = moves[(cur, member)](state), member
    state, m = _step(progs[cur], state, r)
    losses.append(float(m["loss"]))
  np.testing.assert_allclose(losses, losses_ref, rtol=2e-5)
  final = moves[(cur, 0)](state) if cur else state
  ref_leaves = jax.tree.leaves(_host(ref.params))
  scale = max(float(np.abs(x).max()) for x in ref_leaves)   # the params' largest magnitude
  for a, b in zip(jax.tree.leaves(_host(final.params)), ref_leaves):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_trainer_switches_online_under_a_drifting_load_and_resumes_on_that_member(tmp_path):
  """A pool of two: from step 4 a router bias makes every token's top-2 experts 0 and 1; the
  ep member (capacity 1.5x) then drops 1 - 2 x 1.5 / 8 = 0.625 of the choices, far over the
  limit, so the online stage moves to the fsep member, whose re-planner gets the load and
  places one replica of each on every device at once, compiling nothing; it drops
  1 - 8 x 1.25 / 16 = 0.375, so it stays; a resume from the last checkpoint lands on that
  member again. The forced routing makes both drops independent of the initial weights: the
  tiny model's own routing (no balance loss) drops 0.20-0.37 before step 4 depending on the
  jax release's initialisation, which a limit of 0.45 leaves alone."""
  import dataclasses

  from moejax.config import CheckpointConfig, StrategyConfig, TrainConfig
  from moejax.train.controllers import Hook, StrategySwitching
  from moejax.train.trainer import Trainer

  cfg = dataclasses.replace(
      CFG, moe=dataclasses.replace(CFG.moe, capacity_factor=1.5, balance_loss_weight=0.0),
      strategy=StrategyConfig(pool=("ep/2x4x1/cf1.5", "fsep/1x4x2/c4/cf1.25"), every=2,
                              max_drop=0.45),
      # Re-planning only when a switch lands on a member (every=100 is never due here).
      planner=dataclasses.replace(CFG.planner, policy="smartmoe", every=100, window=1),
      checkpoint=CheckpointConfig(every=4),
      train=TrainConfig(run_dir=str(tmp_path), num_steps=10, eval_every=100, eval_batches=1,
                        progress_bar=False),
      data=dataclasses.replace(CFG.data, max_corpus_bytes=100_000))

  class Drift(Hook):
    def before_step(self, trainer, step):
      if step == 4:
        for member, prog in enumerate(trainer.pool.programs):
          bias = np.zeros(prog.layout.router_bias_LxE.shape, np.float32)
          bias[:, :2] = 10.0
          trainer.pool.set_layout(member, prog.layout.replace(router_bias_LxE=bias))

  switch_compiles = []

  class Counted(Hook):   # the train steps are AOT executables: they cannot recompile
    def __init__(self, inner):
      self.inner = inner

    def before_step(self, trainer, step):
      with CompileCounter() as c:
        switched = self.inner.before_step(trainer, step)
      switch_compiles.append(c.count)
      return switched

    def after_metrics(self, *args):
      self.inner.after_metrics(*args)

  trainer = Trainer(cfg)
  trainer.controllers = [Counted(h) if isinstance(h, StrategySwitching) else h
                         for h in trainer.controllers]
  trainer.run(hooks=[Drift()])
  import json
  records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  switches = [r for r in records if r.get("event") == "strategy_switch"]
  assert switches and switches[0]["to"] == "fsep/1x4x2/c4/cf1.25"
  # The step in flight at the switch ran on the ep member (8 sources, the fsep one has 4)
  # and is recorded as such; the next runs on fsep.
  by_step = {r["step"]: r for r in records if "loss" in r}
  at = switches[0]["step"]
  assert by_step[at - 1]["strategy"] == "ep/2x4x1/cf1.5"
  assert by_step[at]["strategy"] == "fsep/1x4x2/c4/cf1.25"
  assert len(by_step[at - 1]["moe"][0]["counts_by_source"]) == 8
  assert len(by_step[at]["moe"][0]["counts_by_source"]) == 4
  assert switches[0]["reason"] == "drops" and switches[0]["step"] >= 5
  assert by_step[at - 1]["moe"][0]["dropped_fraction"] == pytest.approx(0.625, abs=0.01)
  assert by_step[at]["moe"][0]["dropped_fraction"] == pytest.approx(0.375, abs=0.01)
  # The fsep member was idle until then: it re-plans its replicas for this load at once.
  # (The ep member's SmartMoE planned its first layout from the first finished step.)
  relayouts = [r for r in records if r.get("event") == "layout_switch" and r["policy"] == "fsep"]
  assert relayouts
  assert relayouts[0]["step"] == switches[0]["step"]
  assert relayouts[0]["predicted_after"] < relayouts[0]["predicted_before"]
  assert [r["strategy"] for r in records if "loss" in r][-1] == "fsep/1x4x2/c4/cf1.25"
  assert len(switch_compiles) == 10 and sum(switch_compiles) == 0, switch_compiles
  with trainer, Trainer(cfg) as resumed:
    assert resumed.maybe_restore() == 10
    assert resumed.pool.program.strategy.spec == "fsep/1x4x2/c4/cf1.25"
    for a, b in zip(jax.tree.leaves(_host(resumed.state)), jax.tree.leaves(_host(trainer.state))):
      np.testing.assert_array_equal(a, b)


def test_compile_counter_counts_compiles_and_executables_from_the_disk_cache():
  def f(x):
    return x * 3.0 + 1.0

  x = jnp.arange(5.0)
  with CompileCounter() as first:
    jax.block_until_ready(jax.jit(f)(x))
  with CompileCounter() as again:   # a new jit object: traced and compiled again (or cache hit)
    jax.block_until_ready(jax.jit(functools.partial(f))(x))
  assert (first.count, again.count) == (1, 1), (first.count, again.count)
