"""Every mode of the MoE path against the single-device reference, outputs and gradients, at
tiny shapes in the README's test command; and a test that each value the config allows (and
each combination the layer builds differently) has such a case here.

The slow tests keep the large cases, drop rules and compiled-program checks; these cases are
the covering set that keeps a fast green run meaningful (on an idle 2-core VM a layer case
takes 2-5 s, the pipeline and the resume 15-30 s; decision 0070).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import MOE_CHOICES, CheckpointConfig, ModelConfig, MoEConfig
from moejax.layout import canonical as convert, host_layout as placement_lib, migrate
from moejax.layout.leaves import EXPERT_WEIGHTS
from moejax.layout.tables import from_placements, from_slot_expert
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.harness import (
  expert_order,
  layer_step,
  reference_step,
  run_against_reference,
)
from moejax.train import step as step_lib
from moejax.train.checkpoint import Checkpointer
from tests.helpers import tokens
from tests.moe_helpers import (
  GRAD_LEN,
  LOSS_LEN,
  SMALL_MOE,
  Y_LEN,
  D,
  E,
  F,
  cached_setup,
  check_pipeline,
  make_params,
  model_lengths,
  model_loss_and_grads,
  random_placement,
  row,
  with_local,
)
from tests.numerics import assert_close, assert_trees_close


@dataclasses.dataclass(frozen=True)
class LayerCase:
  """One MoE layer build: the config's string knobs, the (data, expert, model) mesh and the
  exchange's pieces. fsep cases run random replicated layouts (3+ replicas of some expert),
  ep cases a random permutation of the experts over the slots."""
  expert_mode: str
  capacity: str
  dispatch: str
  kernels: str
  shape: tuple[int, int, int]
  exchange_chunks: int = 1
  gate: str = "softmax"
  fsep_shares: str = "planned"
  pallas_backend: str = "auto"
  n_group: int = 1       # > 1: group-limited routing, the best half of the groups

  def modes(self) -> dict:
    """(knob, value) pairs this case runs, in the coverage test's terms."""
    modes = {k: getattr(self, k) for k in ("expert_mode", "capacity", "dispatch", "kernels",
                                           "gate")}
    if self.kernels == "pallas":
      modes["pallas_backend"] = self.pallas_backend
    if self.expert_mode == "fsep":
      modes["fsep_shares"] = self.fsep_shares
    modes["mesh.model"] = "1" if self.shape[2] == 1 else ">1"
    modes["moe.exchange_chunks"] = "1" if self.exchange_chunks == 1 else ">1"
    modes["mesh.stage"] = "1"
    modes["moe.n_group"] = "1" if self.n_group == 1 else ">1"
    return modes

  def __str__(self) -> str:
    extra = [f"k{self.exchange_chunks}"] if self.exchange_chunks > 1 else []
    extra += [self.gate] if self.gate != "softmax" else []
    extra += [self.fsep_shares] if self.expert_mode == "fsep" else []
    extra += [f"g{self.n_group}"] if self.n_group > 1 else []
    return "-".join([self.expert_mode, self.capacity, self.dispatch, self.kernels,
                     "x".join(map(str, self.shape))] + extra)


LAYER_CASES = [
    LayerCase("ep", "slot", "dense", "xla", (2, 4, 1), exchange_chunks=2),
    LayerCase("ep", "slot", "dense", "pallas", (2, 2, 2), pallas_backend="interpret"),
    LayerCase("ep", "device", "dense", "xla", (2, 4, 1), exchange_chunks=2, gate="sigmoid",
              n_group=4),
    LayerCase("ep", "slot", "ragged", "xla", (1, 8, 1)),
    LayerCase("fsep", "slot", "dense", "xla", (1, 4, 2)),
    LayerCase("fsep", "device", "dense", "pallas", (2, 4, 1), fsep_shares="adaptive"),
    # fsep's pooled buffer through the XLA kernels: the static-tile SwiGLU over its slots
    LayerCase("fsep", "device", "dense", "xla", (1, 8, 1)),
    LayerCase("fsep", "slot", "ragged", "pallas", (1, 4, 2), exchange_chunks=2,
              fsep_shares="adaptive", gate="sigmoid", n_group=2),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=str)
def test_layer_mode_matches_reference(case, request):
  if case.dispatch == "ragged":      # XLA:CPU has no ragged_all_to_all: its emulation
    request.getfixturevalue("emulated_collective")
  mesh = mesh_of_shape(case.shape)
  n = case.shape[1]
  rng = np.random.default_rng(len(str(case)))
  if case.expert_mode == "fsep":
    slots = 4
    placement = random_placement(rng, n, slots)
    if case.fsep_shares == "planned":       # per-source shares: a device's own tokens first
      placement = with_local(placement, rng)
    max_replicas = n
  else:
    slots = E // n
    placement = placement_lib.Placement(rng.permutation(E).astype(np.int32), np.ones(E), n)
    max_replicas = 1
  layout = jax.device_put(from_placements([placement], E, max_replicas),
                          NamedSharding(mesh, P()))
  # A factor of N*C makes every buffer, per slot or pooled per device, hold all of a
  # source's choices: nothing drops, so the layer must equal the dropless reference.
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=float(n * slots), d_ff=F,
                  expert_mode=case.expert_mode, capacity=case.capacity, dispatch=case.dispatch,
                  kernels=case.kernels, pallas_backend=case.pallas_backend,
                  exchange_chunks=case.exchange_chunks, gate=case.gate,
                  fsep_shares=case.fsep_shares, ragged_buffer_factor=0.0,
                  n_group=case.n_group, topk_group=max(1, case.n_group // 2))
  cfg.validate()
  # ep: expert e's weights in its slot of the layout, gradients mapped back to expert order
  run = run_against_reference(cfg, mesh, make_params(3),
                              jax.random.normal(jax.random.key(4), (8, 8, D)), row(layout))

  assert run.dropped == 0
  np.testing.assert_array_equal(np.asarray(run.stats.counts_WxE).sum(0), run.ref_counts)
  assert_close(run.y, run.ref_y, Y_LEN, err_msg="y")
  assert_close(run.loss, run.ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(run.grads, run.ref_grads, GRAD_LEN)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(run.grads)), "a gradient is all zero"


# Modes beyond one layer build: the model on a pipeline, a migration, and a checkpoint resumed
# in the other expert mode; each compared with the reference (the model on one device).
MODEL_MODES = {
    "test_pipeline_two_stages_matches_one_device":
        {"mesh.stage": ">1", "expert_mode": "fsep", "capacity": "device"},
    "test_migrated_layer_matches_reference": {"migration": "ep"},
    "test_ep_checkpoint_resumes_in_fsep_mode_and_back": {"resume": "ep<->fsep"},
    "test_latent_attention_model_matches_one_device":
        {"model.kv_lora_rank": ">0", "moe.n_group": ">1", "mesh.model": ">1", "gate": "sigmoid"},
}
# Two MoE layers (no dense blocks) at d = 16: the smallest model these paths run through.
MODEL = ModelConfig(d_model=16, num_layers=2, num_heads=2, d_ff=16, max_seq_len=16)
EP_MOE = dataclasses.replace(SMALL_MOE, d_ff=16)
FSEP_MOE = dataclasses.replace(EP_MOE, expert_mode="fsep", slots_per_device=4)


def test_pipeline_two_stages_matches_one_device():
  """P = 2 (one layer group each), fsep with replicas under pooled capacity: the two whose
  vmap over stages the layer builds without shard_map's varying-axes check."""
  moe = dataclasses.replace(FSEP_MOE, capacity="device", slots_per_device=0)  # 4 (8 on one)
  check_pipeline(MODEL, moe, (1, 4, 1), stages=2, micro=2)


# DeepSeek-V3's blocks in small: a dense first layer, multi-head latent attention with the
# low-rank query and YaRN, a sigmoid router limited to 2 of 4 expert groups, a shared expert.
MLA_MODEL = dataclasses.replace(
    MODEL, num_layers=3, kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
    v_head_dim=6, rope_scaling="yarn", rope_factor=2.0, rope_original_max_len=8,
    rope_mscale=1.0, rope_mscale_all_dim=1.0)
DS_MOE = dataclasses.replace(EP_MOE, first_dense=1, gate="sigmoid", route_scale=2.5,
                             n_group=4, topk_group=2, num_shared_experts=1, shared_d_ff=8)


def test_latent_attention_model_matches_one_device():
  """The model with MLA (heads over `model`) and group-limited routing on 1 x 4 x 2 gives the
  one-device model's loss, expert counts and gradients."""
  ref_loss, ref_grads, ref_aux, _ = model_loss_and_grads((1, 1, 1), MLA_MODEL, DS_MOE)
  loss, grads, aux, _ = model_loss_and_grads((1, 4, 2), MLA_MODEL, DS_MOE)
  loss_len, grad_len = model_lengths(MLA_MODEL, DS_MOE)
  latent = 2 * (MLA_MODEL.kv_lora_rank + MLA_MODEL.q_lora_rank)   # the latents' dots and norms
  assert int(np.sum(aux["dropped_LxW"])) == 0
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1),
                                np.asarray(ref_aux["counts_LxWxE"]).sum(1))
  assert_close(loss, ref_loss, loss_len + latent, err_msg="loss")
  assert_trees_close(grads, ref_grads, grad_len + 2 * latent)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads)), "a gradient is all zero"


def _model_value_and_grad(model, moe_cfg):
  return jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=moe_cfg), has_aux=True))


def _check_model(loss, grads_ep_canonical, aux):
  """Loss and canonical ep gradients against the small model on one device."""
  ref_loss, ref_grads, ref_aux, _ = model_loss_and_grads((1, 1, 1), MODEL, EP_MOE)
  loss_len, grad_len = model_lengths(MODEL, EP_MOE)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1),
                                np.asarray(ref_aux["counts_LxWxE"]).sum(1))
  assert_close(float(loss), ref_loss, loss_len, err_msg="loss")
  assert_trees_close(jax.device_get(grads_ep_canonical), ref_grads, grad_len)


def _permuted(mesh, seed):
  """A random permutation of each MoE layer's experts over the slots, as a Layout."""
  rng = np.random.default_rng(seed)
  return jax.device_put(from_slot_expert(np.stack([rng.permutation(E) for _ in range(2)]), E),
                        NamedSharding(mesh, P()))


def test_migrated_layer_matches_reference():
  """An ep migration between two random permutations moves each expert's weights and Adam
  moments to its new slot (exactly), and the layer on the moved weights under the new layout
  equals the reference, gradients mapped back to expert order."""
  mesh, n = mesh_of_shape((2, 4, 1)), 4
  rng = np.random.default_rng(5)
  old, new = (jax.device_put(from_placements([placement_lib.Placement(
      rng.permutation(E).astype(np.int32), np.ones(E), n)], E, 1), NamedSharding(mesh, P()))
      for _ in range(2))
  params = make_params(5)
  in_slots = {k: params[k][np.asarray(old.slot_expert_LxS[0])][None] for k in EXPERT_WEIGHTS}
  tree = jax.device_put({"params": {"moe": in_slots},
                         "mu": {"moe": jax.tree.map(jnp.negative, in_slots)}},
                        NamedSharding(mesh, P(None, "expert")))     # slots over devices
  moved = migrate.migrate(tree, old, new)
  new_order = np.asarray(new.slot_expert_LxS[0])
  for k in EXPERT_WEIGHTS:
    np.testing.assert_array_equal(moved["params"]["moe"][k][0], params[k][new_order])
    np.testing.assert_array_equal(moved["mu"]["moe"][k][0], -params[k][new_order])

  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=float(E), d_ff=F)
  slot_params = {"router": params["router"], **{k: v[0] for k, v in moved["params"]["moe"].items()}}
  x = jax.random.normal(jax.random.key(6), (8, 8, D))
  (loss, (y, st)), grads = layer_step(cfg, mesh)(slot_params, x, row(new))
  (ref_loss, (ref_y, _)), ref_grads = reference_step(cfg)(params, x)
  assert int(np.sum(st.dropped_W)) == 0
  assert_close(y, ref_y, Y_LEN, err_msg="y")
  assert_close(loss, ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close((expert_order(grads[0], row(new)), grads[1]), ref_grads, GRAD_LEN)


def test_ep_checkpoint_resumes_in_fsep_mode_and_back(tmp_path):
  """A permuted ep state saved on 2x4x1 restores into fsep on 1x4x2 (replicas) and computes
  the one-device model's loss and gradients; saved there, it restores into ep unchanged."""
  mesh, _, _, layout0, _, ep_state = cached_setup((2, 4, 1), MODEL, EP_MOE)
  layout = _permuted(mesh, 1)
  ep_state = migrate.migrate(ep_state, layout0, layout)
  ckpt = Checkpointer(str(tmp_path), CheckpointConfig())
  try:
    ckpt.save(1, ep_state, layout, {"data_position": 0})
    ckpt.wait()
    _, fsep_model, _, fsep_layout, _, fsep_like = cached_setup((1, 4, 2), MODEL, FSEP_MOE)
    restored = ckpt.restore(fsep_like, fsep_layout, "fsep")
    assert restored.meta["expert_mode_saved"] == "ep"
    (loss, aux), grads = _model_value_and_grad(fsep_model, FSEP_MOE)(
        restored.state.params, batch_BxQ1=tokens(), layout=restored.layout)
    _check_model(loss, convert.convert_tree(grads, "fsep", "ep"), aux)

    ckpt.save(2, restored.state, restored.layout, {"data_position": 0}, "fsep")
    ckpt.wait()
    back = ckpt.restore(ep_state, layout, "ep")
  finally:
    ckpt.close()
  assert back.step == 2 and back.meta["expert_mode_saved"] == "fsep"
  want = jax.device_get(convert.to_canonical(ep_state, layout))
  for a, b in zip(jax.tree.leaves(jax.device_get(convert.to_canonical(back.state, back.layout))),
                  jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


# The numeric knobs whose values take another path: F sharded over `model`, the exchange in
# pieces, layer groups on pipeline stages, routing by expert groups, latent attention (the
# default's attention runs in every other case); plus the two state moves.
NUMERIC_MODES = {"mesh.model": ("1", ">1"), "moe.exchange_chunks": ("1", ">1"),
                 "moe.n_group": ("1", ">1"), "model.kv_lora_rank": (">0",),
                 "mesh.stage": ("1", ">1"), "migration": ("ep",), "resume": ("ep<->fsep",)}
# Values no CPU can run; their kernels compile in the GPU tests (test_pallas_kernels.py).
GPU_ONLY = {("pallas_backend", "triton"), ("pallas_backend", "mosaic_gpu")}
# Combinations the layer builds differently (moejax/model/moe/layer.py), each needing a case.
SPECIAL = [
    ({"capacity": "slot", "kernels": "xla"}, "per-slot buffers, batched einsum"),
    ({"capacity": "slot", "kernels": "pallas"}, "per-slot buffers, grouped matmul kernels"),
    ({"capacity": "device", "kernels": "xla"}, "pooled buffers, tiled grouped matmul"),
    ({"capacity": "device", "kernels": "pallas"}, "pooled buffers, Pallas grouped matmul"),
    ({"dispatch": "ragged", "kernels": "xla"}, "ragged exchange, XLA grouped matmul"),
    ({"dispatch": "ragged", "kernels": "pallas"}, "ragged exchange, Pallas kernels"),
    ({"fsep_shares": "adaptive", "dispatch": "dense"}, "adaptive shares capped by the buffer"),
    ({"fsep_shares": "adaptive", "dispatch": "ragged"}, "adaptive shares without a cap"),
    ({"expert_mode": "fsep", "mesh.model": ">1"}, "restore over (expert, model) shards"),
    ({"kernels": "pallas", "mesh.model": ">1"}, "interpreted kernels on F shards"),
    ({"capacity": "device", "moe.exchange_chunks": ">1"}, "pooled buffers per piece"),
    ({"dispatch": "ragged", "moe.exchange_chunks": ">1"}, "ragged buffers per piece"),
    ({"mesh.stage": ">1", "expert_mode": "fsep"}, "replica split vmapped over stages"),
    ({"mesh.stage": ">1", "capacity": "device"}, "pooled capacity vmapped over stages"),
    ({"moe.n_group": ">1", "expert_mode": "fsep"}, "groups chosen before the replica split"),
]


def _covered() -> list[dict]:
  return [case.modes() for case in LAYER_CASES] + list(MODEL_MODES.values())


def test_every_mode_has_a_fast_equivalence_case():
  """Each value of each of MoEConfig's string knobs (config.MOE_CHOICES), each numeric mode
  and each special combination appears in a case above, and those cases are in the fast tier."""
  string_fields = {f.name for f in dataclasses.fields(MoEConfig) if f.type == "str"}
  assert string_fields == set(MOE_CHOICES), (
      f"MoEConfig's string knobs {sorted(string_fields ^ set(MOE_CHOICES))} are missing from "
      "config.MOE_CHOICES or it names a knob MoEConfig lacks")
  covered = {(k, v) for modes in _covered() for k, v in modes.items()}
  wanted = {(k, v) for k, values in {**MOE_CHOICES, **NUMERIC_MODES}.items() for v in values}
  missing = sorted(wanted - GPU_ONLY - covered)
  assert not missing, f"modes without a fast equivalence case in tests/test_modes.py: {missing}"
  for combo, why in SPECIAL:
    assert any(combo.items() <= modes.items() for modes in _covered()), (
        f"no fast case runs {combo} ({why})")
  tests = {name: globals().get(name) for name in
           ["test_layer_mode_matches_reference", *MODEL_MODES]}
  assert all(tests.values()), f"MODEL_MODES names a test that does not exist: {tests}"
  slow = [n for n, fn in tests.items()
          if any(m.name == "slow" for m in getattr(fn, "pytestmark", []))]
  assert not slow, f"the covering cases must run in the README's test command: {slow}"
