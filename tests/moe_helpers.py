"""What the MoE layer's tests share beyond the harness (moejax.model.moe.harness): their sizes,
the reduction lengths their tolerances scale with, random layouts, numpy oracles of the drop
rules, and the whole-model and pipeline set-ups."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import OptimConfig, num_moe_layers
from moejax.layout import host_layout as placement_lib
from moejax.model import layer_order
from moejax.model.mesh import mesh_of_shape, param_rules
from moejax.model.moe.harness import init_params
from moejax.model.pipeline import Pipelined
from moejax.model.transformer import Transformer
from moejax.strategy import stages as stage_cost
from moejax.train import step as step_lib
from moejax.train.optim import optimizer
from moejax.train.programs import initial_layout
from moejax.train.state import init_state, state_shardings
from tests import hlo
from tests.helpers import BATCH, SEQ, TINY_MODEL, TINY_MOE, tiny_setup, tokens
from tests.numerics import assert_close, assert_trees_close

E, D, F = 8, 16, 32
MESHES = [(1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]

# Two MoE layers and no dense blocks: for properties of the MoE layers and layouts (not of the
# dense blocks), at about half the compile and run time of the tiny model.
SMALL_MODEL = dataclasses.replace(TINY_MODEL, num_layers=2)
SMALL_MOE = dataclasses.replace(TINY_MOE, moe_every=1)


@functools.cache
def _built(shape, model_cfg, moe_cfg):
  built = tiny_setup(shape, model_cfg, moe_cfg)
  copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=built[4])
  return built, copy


def cached_setup(shape, model_cfg=SMALL_MODEL, moe_cfg=SMALL_MOE):
  """tiny_setup, built once per (mesh shape, configs) in a process; each call gets its own
  copy of the state (same shardings), which a step may donate."""
  (mesh, model, tx, layout, shardings, state), copy = _built(shape, model_cfg, moe_cfg)
  return mesh, model, tx, layout, shardings, copy(state)


# float32 reduction lengths along each compared value's path, for tests/numerics.py's
# tolerances. The layer tests run 8 x 8 tokens: y = the router's dot over D, the experts' over
# D then F; the harness's objective sums y's TOKENS x D squares; gradients go back through F
# and D and the weights' sums over their tokens' top-2 rows.
TOKENS = 64
Y_LEN = 2 * D + F
LOSS_LEN = Y_LEN + TOKENS * D
GRAD_LEN = Y_LEN + D + F + 2 * TOKENS


def model_lengths(model_cfg=TINY_MODEL, moe_cfg=TINY_MOE) -> tuple[int, int]:
  """(loss, grad) reduction lengths of the whole model on tests.helpers' batch: per layer the
  attention's dots over D (q, k, v), J (scores), Q (values) and H*J = D (output) and the MLP's
  over D and F; then the unembedding over D, the softmax over V and the mean over the B*Q
  tokens; gradients go back through every layer and sum over the tokens once more."""
  d, f = model_cfg.d_model, max(model_cfg.d_ff, moe_cfg.d_ff)
  layers = model_cfg.num_layers * (3 * d + d // model_cfg.num_heads + SEQ + f)
  loss = layers + d + model_cfg.vocab_size + BATCH * SEQ
  return loss, loss + layers + BATCH * SEQ


def row(layout, layer=0):
  """One MoE layer's row of a Layout."""
  return jax.tree.map(lambda a: a[layer], layout)


def make_params(seed=0):
  """The layer tests' parameters (E, D, F above), expert-id order; a router of unit scale
  routes decisively, so that no choice is a near tie between experts."""
  return init_params(jax.random.key(seed), D, F, E, router_std=1.0)


def random_placement(rng, num_devices, slots, num_experts=E):
  """All slots filled, >= 1 replica per expert, <= 1 replica of an expert per device,
  some experts with 3+ replicas, random token shares."""
  while True:
    extra = rng.multinomial(num_devices * slots - num_experts,
                            rng.dirichlet(np.full(num_experts, 0.3)))
    reps = 1 + np.minimum(extra, num_devices - 1)
    if reps.sum() != num_devices * slots or reps.max() < 3:
      continue
    slot_expert = rng.permutation(np.repeat(np.arange(num_experts), reps)).astype(np.int32)
    per_dev = slot_expert.reshape(num_devices, slots)
    if all(len(set(row)) == slots for row in per_dev):
      break
  share = np.zeros(len(slot_expert))
  for e in range(num_experts):
    mine = np.flatnonzero(slot_expert == e)
    share[mine] = rng.dirichlet(np.ones(len(mine)))
  return placement_lib.Placement(slot_expert, share, num_devices)


def with_local(placement, rng):
  """The placement with random per-source shares: each slot keeps nothing (a third), all
  (a third) or a random number of parts of its own device's tokens first."""
  pick = rng.integers(0, 3, len(placement.slot_expert))
  parts = np.where(pick == 0, 0, np.where(pick == 1, placement_lib.SHARE_PARTS,
                                          rng.integers(1, placement_lib.SHARE_PARTS, len(pick))))
  return placement_lib.Placement(placement.slot_expert, placement.share,
                                 placement.num_devices, "split", parts / placement_lib.SHARE_PARTS)


FSEP_MOE = dataclasses.replace(SMALL_MOE, expert_mode="fsep", slots_per_device=4)


@functools.cache
def model_loss_and_grads(shape, model_cfg=TINY_MODEL, moe_cfg=TINY_MOE):
  """(loss, grads, aux, state) of a whole model on the `tokens()` batch on mesh `shape`,
  computed once per process."""
  _, model, _, layout, _, state = cached_setup(shape, model_cfg, moe_cfg)
  f = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=moe_cfg), has_aux=True))
  (loss, aux), grads = f(state.params, batch_BxQ1=tokens(), layout=layout)
  return float(loss), jax.device_get(grads), jax.device_get(aux), state


@functools.cache
def fsep_loss_and_grad(shape, slots):
  """(jitted loss-and-grad of the small fsep model, its params, layout), built once per shape."""
  moe = dataclasses.replace(FSEP_MOE, slots_per_device=slots)
  _, model, _, layout, _, state = cached_setup(shape, SMALL_MODEL, moe)
  f = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=moe), has_aux=True))
  return f, state.params, layout


def pooled_keep(slot_TK: np.ndarray, slots: int, cap_dev: int) -> np.ndarray:
  """The pooled-capacity drop rule for one source, in numpy: its choices ordered by device,
  slot, then token order; the first `cap_dev` to each device are kept. Bool [T*K]."""
  slot_TK = np.asarray(slot_TK)
  keep_TK = np.zeros(slot_TK.shape, bool)
  taken = {}
  for a in np.argsort(slot_TK, kind="stable"):
    dev = int(slot_TK[a]) // slots
    taken[dev] = taken.get(dev, 0) + 1
    keep_TK[a] = taken[dev] <= cap_dev
  return keep_TK


def ragged_keep(slot_WxTK: np.ndarray, slots: int, rows: int) -> np.ndarray:
  """The bounded ragged buffer's drop rule in numpy, for the sources of one data row in
  order: each destination's `rows` fill source by source, a source's choices slot by slot in
  token order. Bool [W, T*K]."""
  slot_WxTK = np.asarray(slot_WxTK)
  keep_WxTK = np.zeros(slot_WxTK.shape, bool)
  filled = {}
  for w, slot_TK in enumerate(slot_WxTK):
    for a in np.argsort(slot_TK, kind="stable"):
      dev = int(slot_TK[a]) // slots
      keep_WxTK[w, a] = filled.get(dev, 0) < rows
      filled[dev] = filled.get(dev, 0) + keep_WxTK[w, a]
  return keep_WxTK


def stage_setup(model_cfg, moe_cfg, shape, stages=1):
  """(model, layout, train state) on a (data, expert, model) x `stages` mesh: what the
  pipeline tests build for each side of a comparison, parameters in canonical layer order."""
  mesh = mesh_of_shape(shape, stage=stages)
  model = Transformer(model_cfg, moe_cfg, mesh)
  layout = jax.device_put(initial_layout(moe_cfg, num_moe_layers(model_cfg, moe_cfg), shape[1]),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  tx = optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1), 10)
  shardings = state_shardings(model, tx, mesh, layout, BATCH, SEQ, param_rules(stage=stages > 1))
  return model, layout, init_state(model, tx, shardings, layout, BATCH, SEQ, 0)


def microbatch_dims(shape, micro, model_cfg=TINY_MODEL):
  """(rows, Q, D) of one device's share of one microbatch of tests.helpers' batch on a
  (data, expert, model) stage shape: what a pipeline's stage send moves."""
  return (BATCH // micro // (shape[0] * shape[1]), SEQ, model_cfg.d_model)


@functools.cache
def pipeline_reference(model_cfg, moe_cfg, micro):
  """Mean loss, gradients and summed counts of the one-device Transformer run microbatch by
  microbatch (rows i % micro == m): the pipeline's definition of the step."""
  model, layout, state = stage_setup(model_cfg, moe_cfg, (1, 1, 1))
  f = jax.jit(jax.value_and_grad(
      lambda p, b: step_lib.loss_fn(p, model, moe_cfg, b, layout), has_aux=True))
  outs = [f(state.params, tokens()[m::micro]) for m in range(micro)]
  loss = np.mean([float(loss) for (loss, _), _ in outs])
  grads = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *[g for _, g in outs])
  counts = sum(np.asarray(aux["counts_LxWxE"]).sum(1) for (_, aux), _ in outs)
  return loss, jax.device_get(grads), counts


def check_pipeline(model_cfg, moe_cfg, shape, stages, micro, virtual=1):
  """The pipeline on a (data, expert, model) x `stages` mesh, V = `virtual`, gives
  `pipeline_reference`'s loss, counts and every gradient (compared in canonical order)."""
  ref_loss, ref_grads, ref_counts = pipeline_reference(model_cfg, moe_cfg, micro)
  model, layout, state = stage_setup(model_cfg, moe_cfg, shape, stages)
  piped = Pipelined(model, micro, virtual)
  order = piped.layer_order
  stored = jax.jit(lambda p: layer_order.params_to(p, order))(state.params)   # circular storage
  f = jax.jit(jax.value_and_grad(
      lambda p, b: step_lib.loss_fn(p, piped, moe_cfg, b, layout), has_aux=True))
  compiled = f.lower(stored, tokens()).compile()
  (loss, aux), grads = compiled(stored, tokens())
  # One send per tick each way (the rotation and its transpose), circular as GPipe.
  sends = hlo.loop_sends(compiled.as_text(), stage_cost.ticks(stages, micro, virtual),
                         microbatch_dims(shape, micro, model_cfg))
  assert sends == [stage_cost.SENDS_PER_TICK // 2] * 2, sends
  grads = layer_order.params_to(jax.device_get(grads), layer_order.inverse(order))
  loss_len, grad_len = model_lengths(model_cfg, moe_cfg)
  assert int(np.sum(aux["dropped_LxW"])) == 0
  assert_close(float(loss), ref_loss, loss_len, err_msg="loss")
  np.testing.assert_array_equal(np.asarray(aux["counts_LxWxE"]).sum(1), ref_counts)
  assert_trees_close(grads, ref_grads, grad_len)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads)), \
      "every parameter gets a gradient through the pipeline"
