"""Elastic restore: a checkpoint saved on one mesh/strategy restores on another (8 -> 4 devices,
ep -> fsep and back) with the same parameters and optimizer state in canonical expert order,
and training goes on. Plus the ep <-> fsep tree conversion itself."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from moejax.config import MeshConfig
from moejax.layout import canonical as convert, leaves
from moejax.layout.migrate import migrate
from moejax.layout.tables import from_slot_expert
from moejax.train import data as data_lib
from moejax.train.checkpoint import Checkpointer
from moejax.train.digest import path_name
from moejax.train.trainer import Trainer
from tests.run_config import tiny_config
from tests.run_helpers import reference_losses  # noqa: F401  (fixture)


def _canonical(state, layout, mode) -> dict[str, np.ndarray]:
  """Params and optimizer state in expert-id order, in ep's tree paths, on the host."""
  state = convert.convert_tree(convert.canonical_state(state, layout, mode), mode, "ep")
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get((state.params, state.opt_state)))[0]
  return {path_name(p): np.asarray(x) for p, x in flat}


def _assert_same(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _train_one_step(trainer) -> float:
  """The next step of the resumed run, through the strategy's own compiled step."""
  prog = trainer.pool.program
  batch = data_lib.make_global_batch(trainer.loader.next_local(), prog.batch_sharding,
                                     trainer.cfg.data.global_batch_size)
  trainer.state, m = prog.train_step(trainer.state, batch, prog.layout)
  assert int(trainer.state.step) == 5 and not bool(m["skipped"])
  return float(m["loss"])


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_restore_on_4_devices_and_in_fsep_mode_then_train_on(tmp_path, reference_losses):  # noqa: F811
  cfg = tiny_config(tmp_path / "a", num_steps=4, every=4)   # the reference run's first 4 steps
  with Trainer(cfg) as a:   # 8 devices, data=2 x expert=4, ep
    # Experts out of id order, as after an online re-placement (weights and Adam state move).
    permuted = jax.device_put(from_slot_expert(np.array([[3, 7, 0, 5, 1, 6, 2, 4]]), 8),
                              a.pool.program.layout_sharding)
    a.state = migrate(a.state, a.pool.layout, permuted)
    a.pool.set_layout(0, permuted)
    a.run()
    saved = _canonical(a.state, a.pool.layout, "ep")

  # 8 -> 4 devices (data=1 x expert=4), same strategy: the layout fits and is kept.
  four = dict(devices=jax.devices()[4:])
  cfg_b = dataclasses.replace(cfg, mesh=MeshConfig(data=1, expert=4, model=1))
  b = Trainer(cfg_b, **four)
  # ... and ep -> fsep on those 4 devices: other tree paths and shardings, another layout.
  c = Trainer(dataclasses.replace(cfg_b, moe=dataclasses.replace(cfg.moe, expert_mode="fsep")),
              **four)
  with b, c:
    assert b.pool.program.mesh.devices.size == c.pool.program.mesh.devices.size == 4
    assert b.maybe_restore() == 4 and not b.restore_warnings
    _assert_same(_canonical(b.state, b.pool.layout, "ep"), saved)
    np.testing.assert_array_equal(np.asarray(b.pool.layout.slot_expert_LxS),
                                  [[3, 7, 0, 5, 1, 6, 2, 4]])
    assert b.loader.position == 4

    fsep_start_layout = np.asarray(c.pool.layout.slot_expert_LxS)
    assert c.maybe_restore() == 4 and c.loader.position == 4
    assert len(c.restore_warnings) == 1 and "does not fit" in c.restore_warnings[0]
    assert "fsep_experts" in c.state.params and "w_up" not in c.state.params["layers"]["moe"]
    _assert_same(_canonical(c.state, c.pool.layout, "fsep"), saved)
    np.testing.assert_array_equal(np.asarray(c.pool.layout.slot_expert_LxS), fsep_start_layout)

    # Training goes on from the restored state (the reference saw step 4 from the same state;
    # another mesh and mode add in another order and drop other tokens at capacity 1.25).
    np.testing.assert_allclose(_train_one_step(c), reference_losses[4], rtol=2e-2)

    # ... and back: an fsep checkpoint restores into the ep strategy on 4 devices.
    c.checkpointer.save(5, c.state, c.pool.layout, {"data_position": 5}, "fsep")
    c.checkpointer.wait()
    back = Checkpointer(str(tmp_path / "a"), cfg.checkpoint).restore(b.state, b.pool.layout,
                                                                      "ep")
    assert back.step == 5 and "does not fit" in back.warnings[0]
    _assert_same(_canonical(back.state, back.layout, "ep"),
                 _canonical(c.state, c.pool.layout, "fsep"))


def test_convert_tree_moves_expert_leaves_both_ways_on_arrays_and_shapes():
  def params(mode):
    moe = {"router": np.ones((1, 4, 8))}
    experts = {w: np.full((1, 8, 4, 6) if w != "w_down" else (1, 8, 6, 4), i, np.float32)
               for i, w in enumerate(leaves.EXPERT_WEIGHTS)}
    root = {"embed": np.zeros((16, 4)), "layers": {"moe": moe, "attn_moe": {"wq": np.ones(2)}}}
    if mode == "ep":
      moe.update(experts)
    else:
      root["fsep_experts"] = experts
    return root

  ep, fsep = params("ep"), params("fsep")
  opt = ({"count": np.int32(3), "mu": ep, "nu": ep}, None)     # optimizer state mirrors params
  moved = convert.convert_tree({"params": ep, "opt_state": opt}, "ep", "fsep")
  for tree in (moved["params"], moved["opt_state"][0]["mu"], moved["opt_state"][0]["nu"]):
    assert jax.tree.structure(tree) == jax.tree.structure(fsep)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(fsep)):
      np.testing.assert_array_equal(x, y)
  assert moved["opt_state"][0]["count"] == 3 and moved["opt_state"][1] is None
  back = convert.convert_tree(moved, "fsep", "ep")
  assert jax.tree.structure(back) == jax.tree.structure({"params": ep, "opt_state": opt})
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), fsep)
  as_ep = convert.convert_tree(shapes, "fsep", "ep")
  assert as_ep["layers"]["moe"]["w_down"].shape == (1, 8, 6, 4) and "fsep_experts" not in as_ep
  assert convert.convert_tree(ep, "ep", "ep") is ep
  with pytest.raises(ValueError, match="expert mode 'tp'"):
    convert.convert_tree(ep, "ep", "tp")
