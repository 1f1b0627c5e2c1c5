"""`model.remat_keeps_exchange`: under remat the MoE exchanges' outputs are kept for the
backward, which then runs no exchange again; loss and gradients are those of the plain step,
on the mesh and on one device."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from moejax.config import Config
from moejax.layout import host_layout as placement_lib
from moejax.layout.tables import from_placements
from moejax.train import step as step_lib
from moejax.train.programs import CompileCounter
from tests import hlo
from tests.helpers import TINY_MODEL, TINY_MOE, tokens
from tests.moe_helpers import (
  cached_setup,
  check_pipeline,
  model_lengths,
  model_loss_and_grads,
  with_local,
)
from tests.numerics import assert_close, assert_trees_close

SHAPE = (1, 4, 1)
REMAT = dataclasses.replace(TINY_MODEL, remat=True)
KEEPS = dataclasses.replace(REMAT, remat_keeps_exchange=True)


def _exchanges(model_cfg, moe_cfg=TINY_MOE, kind: str = "all-to-all") -> int:
  """`kind` calls (all-to-all: exchanges) per step of the tiny model's loss and gradient on
  SHAPE's mesh."""
  _, model, _, layout, _, state = cached_setup(SHAPE, model_cfg, moe_cfg)
  f = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=moe_cfg), has_aux=True))
  text = f.lower(state.params, batch_BxQ1=tokens(), layout=layout).compile().as_text()
  return hlo.collective_calls(text).get(kind, 0)


def test_keeping_the_exchange_gives_the_plain_steps_loss_and_gradients():
  loss_len, grad_len = model_lengths()
  loss, grads = model_loss_and_grads(SHAPE, KEEPS)[:2]
  for reference in (SHAPE, (1, 1, 1)):       # the plain step on the mesh and on one device
    ref_loss, ref_grads = model_loss_and_grads(reference)[:2]
    assert_close(loss, ref_loss, loss_len, err_msg="loss")
    assert_trees_close(grads, ref_grads, grad_len)


def test_pipeline_ticks_keeping_the_exchange_give_the_reference():
  check_pipeline(KEEPS, TINY_MOE, (1, 2, 1), stages=2, micro=2)


# (exchanges a layer's forward runs, its backward's transposes): the per-slot einsum
# exchanges rows both ways; the grouped and pooled paths also the kept-row counts, integers
# with no transpose, named alike
PATHS = {"einsum": ({}, 2, 2), "grouped": ({"kernels": "pallas"}, 3, 2),
         "pooled": ({"capacity": "device"}, 3, 2)}


@pytest.mark.parametrize("path", list(PATHS))
def test_the_backward_runs_no_exchange_again(path):
  fields, forward, backward = PATHS[path]
  moe = dataclasses.replace(TINY_MOE, **fields)
  layers = TINY_MODEL.num_layers // TINY_MOE.moe_every
  plain, remat, keeps = (_exchanges(cfg, moe) for cfg in (TINY_MODEL, REMAT, KEEPS))
  assert plain == (forward + backward) * layers, plain
  assert remat == plain + forward * layers, remat      # full remat runs the forward's again
  assert keeps == plain, keeps


@pytest.mark.parametrize("model_cfg", [REMAT, KEEPS], ids=["remat", "keeps_exchange"])
def test_remat_runs_no_all_reduce_again(model_cfg):
  """A rematerialised layer keeps the balance loss's global shares per expert
  (moejax.model.moe.route.SHARES), so its backward recomputes no psum: as many all-reduces as
  the plain step (on GPU the recomputed one queued behind the layer's weight gathers)."""
  assert _exchanges(model_cfg, kind="all-reduce") == _exchanges(TINY_MODEL, kind="all-reduce")


def test_without_remat_it_changes_nothing():
  cfg = Config()
  off = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                          remat_keeps_exchange=True))
  off.validate()           # a config that sets it beside model.remat = False stays valid
  assert _exchanges(dataclasses.replace(TINY_MODEL, remat_keeps_exchange=True)) == \
      _exchanges(TINY_MODEL)


# fsep's MoE layer recomputes in its own backward pass (moejax.model.moe.fsep_backward), with or
# without remat: its forward records the exchanges' values and the recompute replays them
# (moejax.model.moe.kept_exchange). Slots per device: 2 on the mesh, every slot on one device.
FSEP = {"per_slot": dataclasses.replace(TINY_MOE, expert_mode="fsep", slots_per_device=2),
        "pooled": dataclasses.replace(TINY_MOE, expert_mode="fsep", slots_per_device=2,
                                      capacity="device")}
KEEPS_ONLY = dataclasses.replace(TINY_MODEL, remat_keeps_exchange=True)


@pytest.mark.parametrize("path", list(FSEP))
def test_fsep_keeping_the_exchange_gives_the_plain_fsep_and_one_device(path):
  moe = FSEP[path]
  loss_len, grad_len = model_lengths(TINY_MODEL, moe)
  loss, grads = model_loss_and_grads(SHAPE, KEEPS_ONLY, moe)[:2]
  one = dataclasses.replace(moe, slots_per_device=moe.num_experts)
  for shape, reference in ((SHAPE, moe), ((1, 1, 1), one)):
    ref_loss, ref_grads = model_loss_and_grads(shape, TINY_MODEL, reference)[:2]
    assert_close(loss, ref_loss, loss_len, err_msg=f"loss against {shape}")
    assert_trees_close(grads, ref_grads, grad_len)


@pytest.mark.parametrize("path", list(FSEP))
def test_fsep_recompute_runs_no_token_exchange_again(path):
  """Per layer, the recompute of a plain fsep layer runs the forward's token exchanges again
  (rows both ways, and the pooled path's kept-row counts); kept, it runs none of them."""
  moe = FSEP[path]
  layers = TINY_MODEL.num_layers // moe.moe_every
  forward = 3 if path == "pooled" else 2
  plain, keeps, remat_keeps = (_exchanges(cfg, moe) for cfg in (TINY_MODEL, KEEPS_ONLY,
                                                                  KEEPS))
  assert keeps == plain - forward * layers, (plain, keeps)
  assert remat_keeps == keeps, remat_keeps


@pytest.mark.parametrize("path", list(FSEP))
def test_fsep_recompute_runs_no_all_reduce_again(path):
  """fsep's forward keeps the balance loss's global shares for the recompute in its backward
  (kept exchange or not), so its step runs as many all-reduces as a plain ep step of the
  same layer, which recomputes nothing (the psum again per layer before: on GPU it queued
  behind the layer's collectives, about 3.7 ms a layer for Qwen3-30B-A3B on 8 H100s)."""
  moe = FSEP[path]
  ep = dataclasses.replace(moe, expert_mode="ep", slots_per_device=0)
  want = _exchanges(TINY_MODEL, ep, kind="all-reduce")
  for model_cfg in (TINY_MODEL, KEEPS_ONLY):
    assert _exchanges(model_cfg, moe, kind="all-reduce") == want, model_cfg


@pytest.mark.parametrize("path", ["per_slot", pytest.param("pooled", marks=pytest.mark.slow)])
def test_fsep_keeping_the_exchange_compiles_nothing_for_a_new_layout(path):
  """The tape holds the exchanges' traced values, never a layout's: the compiled step runs
  other placements (experts moved between the 8 slots, then per-source shares) without
  compiling, with the loss and gradients of the first (nothing dropped: a placement moves
  work, not the math)."""
  moe = FSEP[path]
  _, model, _, layout, _, state = cached_setup(SHAPE, KEEPS_ONLY, moe)
  f = jax.jit(jax.value_and_grad(
      functools.partial(step_lib.loss_fn, model=model, moe_cfg=moe), has_aux=True))
  (loss, first), grads = f(state.params, batch_BxQ1=tokens(), layout=layout)
  loss_len, grad_len = model_lengths(TINY_MODEL, moe)
  experts, devices = moe.num_experts, SHAPE[1]
  layers, replicas = layout.expert_slots_LxExR.shape[0], layout.expert_slots_LxExR.shape[2]
  shardings = jax.tree.map(lambda a: a.sharding, layout)
  rng = np.random.default_rng(0)
  for i in range(3):
    moved = [placement_lib.Placement(rng.permutation(experts).astype(np.int32),
                                     np.ones(experts), devices) for _ in range(layers)]
    if i:
      moved = [with_local(p, rng) for p in moved]
    new = jax.device_put(from_placements(moved, experts, replicas), shardings)
    with CompileCounter() as compiles:
      (new_loss, aux), new_grads = f(state.params, batch_BxQ1=tokens(), layout=new)
      jax.block_until_ready(new_loss)
    assert compiles.count == 0, f"layout {i} compiled {compiles.count} programs"
    # the slots' work follows the new placement; the experts' does not change
    assert not np.array_equal(aux["slot_counts_LxWxS"], first["slot_counts_LxWxS"])
    np.testing.assert_array_equal(aux["counts_LxWxE"], first["counts_LxWxE"])
    assert_close(new_loss, loss, loss_len, err_msg=f"layout {i}: loss")
    assert_trees_close(new_grads, grads, grad_len)
  assert f._cache_size() == 1
