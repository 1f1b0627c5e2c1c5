"""Migration in ep mode moves weights and every optimizer-state leaf with the expert."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.layout import leaves, migrate
from moejax.layout.tables import from_slot_expert
from moejax.train import checkpoint, step as step_lib
from tests.helpers import tokens
from tests.moe_helpers import SMALL_MODEL, SMALL_MOE, cached_setup, model_lengths
from tests.numerics import assert_close

STEPS = 3
SEQUENCES = 20


def _random_layout(rng, layers=2, experts=8):
  return from_slot_expert(np.stack([rng.permutation(experts) for _ in range(layers)]), experts)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
@pytest.mark.parametrize("shape", [(2, 4, 1), (1, 8, 1)], ids=lambda s: "x".join(map(str, s)))
def test_training_with_migrations_matches_training_without(shape):
  mesh, model, tx, layout0, shardings, state0 = cached_setup(shape)
  fresh = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, moe_cfg=SMALL_MOE,
                                   lr_schedule=lambda s: 1e-2),
                 in_shardings=(shardings, None, rep), out_shardings=(shardings, rep),
                 donate_argnums=0)
  batches = [tokens(10 + t) for t in range(STEPS)]
  loss_len, grad_len = model_lengths(SMALL_MODEL, SMALL_MOE)

  state = fresh(state0)
  ref_losses = []
  for t in range(STEPS):
    state, m = step(state, batches[t], layout0)
    assert int(np.sum(m["dropped_LxW"])) == 0
    ref_losses.append(float(m["loss"]))
  ref = jax.device_get(state)          # static layout == canonical order

  rng = np.random.default_rng(0)
  for seq in range(SEQUENCES):
    state, layout = fresh(state0), layout0
    for t in range(STEPS):
      new = jax.device_put(_random_layout(rng), rep)
      state = migrate.migrate(state, layout, new)
      layout = new
      state, m = step(state, batches[t], layout)
      assert_close(m["loss"], ref_losses[t], loss_len, err_msg=f"sequence {seq} step {t}")
    canon = jax.device_get(checkpoint.to_canonical(state, layout))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(canon), jax.tree.leaves(ref)):
      assert_close(a, b, STEPS * grad_len, err_msg=f"sequence {seq}: {jax.tree_util.keystr(path)}")
  assert step._cache_size() == 1, "a layout change recompiled the train step"


@pytest.mark.slow   # with the fresh venv's install, over the 8-minute budget
def test_migration_moves_adam_moments_with_the_expert():
  _, _, _, layout0, _, state = cached_setup((2, 4, 1))
  # Mark every expert's first moment with its expert id so we can follow it.
  mu = state.opt_state[1][0].mu
  marked = jax.tree_util.tree_map_with_path(
      lambda p, x: (x * 0 + np.arange(8).reshape((1, 8) + (1,) * (x.ndim - 2)))
      if leaves.is_expert_leaf(p) else x, mu)
  state = state.replace(opt_state=(state.opt_state[0],
                                   (state.opt_state[1][0]._replace(mu=marked),)
                                   + tuple(state.opt_state[1][1:])))
  new = _random_layout(np.random.default_rng(5))
  moved = migrate.migrate(state, layout0, new)
  slot_expert = np.asarray(new.slot_expert_LxS)
  got = np.asarray(moved.opt_state[1][0].mu["layers"]["moe"]["w_up"])
  for layer in range(2):
    for s in range(8):
      assert np.all(got[layer, s] == slot_expert[layer, s])


@pytest.mark.slow   # over the 8-minute budget of the README test command: .ci/run's slow pass
def test_migration_compiles_once_for_many_layouts():
  mesh, _, _, layout, _, state = cached_setup((2, 4, 1))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # Other tests in the same process leave their own permuters behind, so count
  # what this loop adds: at most one new executable over all cached permuters.
  # Both kinds: the whole permutation and the moved-only program within the budget.
  for programs in (migrate._PERMUTERS, migrate._MOVERS):
    before = {key: fn._cache_size() for key, fn in programs.items()}
    rng = np.random.default_rng(7)
    for _ in range(4):
      new = jax.device_put(_random_layout(rng), rep)
      state = migrate.migrate(state, layout, new, whole=programs is migrate._PERMUTERS,
                              budget=None if programs is migrate._PERMUTERS else 2)
      layout = new
    jax.block_until_ready(state)
    grown = sum(fn._cache_size() - before.get(key, 0) for key, fn in programs.items())
    assert len(programs) - len(before) <= 1
    assert grown <= 1, f"4 layout changes compiled {grown} programs, expected at most 1"
