"""Layouts are data: validation, canonical order, and no recompilation on change."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.layout.tables import from_slot_expert, static_layout
from moejax.train import checkpoint, step as step_lib
from tests.helpers import tokens
from tests.moe_helpers import SMALL_MOE, cached_setup


def test_static_layout_places_expert_e_on_device_e_div_c():
  layout = static_layout(num_layers=2, num_experts=8, num_devices=4)
  np.testing.assert_array_equal(np.asarray(layout.slot_expert_LxS), np.tile(np.arange(8), (2, 1)))
  np.testing.assert_array_equal(np.asarray(layout.expert_slot_LxE) // 2,
                                np.tile(np.arange(8) // 2, (2, 1)))


def test_non_permutation_is_rejected():
  with pytest.raises(ConfigError, match="not a permutation"):
    from_slot_expert(np.array([[0, 0, 1, 2]]), 4)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_canonical_roundtrip_under_permuted_layout():
  _, _, _, _, _, state = cached_setup((2, 4, 1))
  rng = np.random.default_rng(0)
  layout = from_slot_expert(np.stack([rng.permutation(8) for _ in range(2)]), 8)
  canon = checkpoint.to_canonical(state, layout)
  # Row e of a canonical expert leaf is the slot that hosts e.
  w = np.asarray(state.params["layers"]["moe"]["w_up"])
  cw = np.asarray(canon.params["layers"]["moe"]["w_up"])
  for layer in range(2):
    for e in range(8):
      np.testing.assert_array_equal(cw[layer, e], w[layer, int(layout.expert_slot_LxE[layer, e])])
  back = checkpoint.from_canonical(canon, layout)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Non-expert leaves (router is indexed by expert id) are untouched.
  np.testing.assert_array_equal(np.asarray(canon.params["layers"]["moe"]["router"]),
                                np.asarray(state.params["layers"]["moe"]["router"]))


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_layout_change_compiles_nothing_new():
  mesh, model, tx, layout, shardings, state = cached_setup((2, 4, 1))
  traces = []

  def counted(*args, **kw):
    traces.append(1)
    return step_lib.train_step(*args, **kw)

  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step = jax.jit(functools.partial(counted, model=model, tx=tx, moe_cfg=SMALL_MOE,
                                   lr_schedule=lambda s: 1e-3),
                 in_shardings=(shardings, None, rep), out_shardings=(shardings, None),
                 donate_argnums=0)
  state, _ = step(state, tokens(), layout)   # warm-up: the one compilation
  assert len(traces) == 1
  rng = np.random.default_rng(1)
  for i in range(4):
    new = from_slot_expert(np.stack([rng.permutation(8) for _ in range(2)]), 8)
    state, m = step(state, tokens(i), jax.device_put(new, rep))
    float(m["loss"])
  assert len(traces) == 1, f"layout changes re-traced the step {len(traces) - 1} times"
  assert step._cache_size() == 1
