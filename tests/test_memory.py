"""Memory accounting: fsep keeps 1/N of every expert, restores C slots per layer."""

from __future__ import annotations

import pytest

from moejax.strategy.memory import FP32, expert_bytes, report


def test_ep_and_fsep_bytes():
  ep = expert_bytes("ep", layers=2, experts=8, d_model=4, d_ff=8, devices=4)
  fs = expert_bytes("fsep", layers=2, experts=8, d_model=4, d_ff=8, devices=4,
                    slots_per_device=4)
  per_expert = 3 * 4 * 8
  assert ep["persistent"] == 3 * 2 * 2 * per_expert * FP32        # 2 experts per device
  assert fs["persistent"] == 3 * 2 * 8 * per_expert // 4 * FP32   # 1/4 of all 8 experts
  assert ep["persistent"] == fs["persistent"]                     # same total, spread out
  assert fs["transient"] == (2 * 8 * per_expert // 4 + 2 * 2 * 4 * per_expert) * FP32
  assert "fsep C=4" in report(2, 8, 4, 8, 4, fsep_slots=4)


def test_ragged_buffer_rows_are_factor_times_the_balanced_share():
  # One function sizes the layer's receive buffer and the memory model's (layout.capacity).
  from moejax.layout.capacity import ragged_rows

  expected = {(8192, 2, 8, 2.0): 32768, (100, 3, 4, 0.0): 1200, (10, 1, 2, 5.0): 20}
  for (tokens, k, n, factor), rows in expected.items():
    assert ragged_rows(tokens, k, n, factor) == rows


def test_activation_terms_name_the_peak():
  """The peak holds the larger of one group's backward and the loss's; a loss tile holds
  chunk/Q of the whole logits' bytes at (4 + 2) / 8 of them; XLA's attention adds (layers per
  group + 1) layers' scores under group remat, 2 under fsep's block remat."""
  from moejax.strategy.memory import activation_bytes, activation_terms, attention_score_bytes

  base = dict(tokens=8192, d_model=768, num_layers=12, vocab_size=50304, expert_rows=6 * 20480,
              act_bytes=2, groups=6, remat=True, heads=12, seq_len=1024)
  whole = activation_terms(**base)
  tiled = activation_terms(**base, loss_chunk=256)
  assert tiled["loss"] == whole["loss"] / 4 * 6 / 8
  scored = activation_terms(**base, attention_scores=True)
  score = attention_score_bytes(8192, 12, 1024, 2)
  assert score == 8192 * 12 * 1024 * 6
  assert scored["work"] - whole["work"] == 3 * score
  blocks = activation_terms(**base, attention_scores=True, remat_blocks=True)
  assert blocks["work"] - whole["work"] == 2 * score
  # two layers a group, each keeping two bf16 [T, D] arrays (its input, the MoE layer's input)
  assert blocks["kept"] == 6 * 2 * 2 * 8192 * 768 * 2
  t = activation_terms(**base, attention_scores=True, loss_chunk=256)
  assert activation_bytes(**base, attention_scores=True, loss_chunk=256) == (
      t["kept"] + max(t["work"], t["loss"]))


def test_keeping_the_exchange_keeps_two_buffers_a_layer_and_recomputes_two_thirds():
  """model.remat_keeps_exchange: every MoE layer's received and returned rows stay through the
  backward (the memory model), and the experts' recomputed forward is gate and up only (the
  cost model): expert time 11/9 of the plain step's where full remat is 4/3; fsep, whose layer
  recomputes in its own backward pass, keeps them with or without remat; not ragged dispatch,
  whose exchanges it does not keep."""
  import dataclasses

  from moejax.config import Config
  from moejax.strategy.cost import PRESETS, predict_step
  from moejax.strategy.memory import activation_terms
  from moejax.strategy.offline import workload_of
  from moejax.strategy.spec import parse

  base = dict(tokens=8192, d_model=768, num_layers=12, vocab_size=50304, expert_rows=6 * 20480,
              act_bytes=2, groups=6, remat=True, heads=12, seq_len=1024)
  plain, keeps = activation_terms(**base), activation_terms(**base, keeps_exchange=True)
  assert keeps["kept"] - plain["kept"] == 2 * 6 * 20480 * 768 * 2
  # a group's recomputed forward makes no exchange buffers of its own
  assert plain["work"] - keeps["work"] == 2 * 20480 * 768 * 2
  w = workload_of(Config())
  remat = dataclasses.replace(w, remat=True)
  kept = dataclasses.replace(remat, remat_keeps_exchange=True)
  prof = PRESETS["h100_node"]
  ep = parse("ep/1x8x1/cf1.25")
  one, full, part = (predict_step(ep, x, prof) for x in (w, remat, kept))
  assert full.expert_s == pytest.approx(one.expert_s * 4 / 3, rel=1e-12)
  assert part.expert_s == pytest.approx(one.expert_s * 11 / 9, rel=1e-12)
  assert part.memory_bytes > full.memory_bytes
  ragged = parse("ep/1x8x1/cf1.25/ragged")
  assert predict_step(ragged, kept, prof) == predict_step(ragged, remat, prof)
  # fsep's layer is recomputed in its own backward pass with or without remat: 4/3 plain,
  # 11/9 and two exchanges fewer a run with the exchanges kept, remat or not
  fsep = parse("fsep/1x8x1/c2/cf1.25")
  plain_f, no_remat_f = predict_step(fsep, remat, prof), predict_step(fsep, w, prof)
  kept_f = predict_step(fsep, kept, prof)
  kept_no_remat_f = predict_step(fsep, dataclasses.replace(w, remat_keeps_exchange=True), prof)
  assert no_remat_f.expert_s == pytest.approx(plain_f.expert_s, rel=1e-12)
  assert kept_f.expert_s == pytest.approx(plain_f.expert_s * (11 / 9) / (4 / 3), rel=1e-12)
  assert kept_no_remat_f.expert_s == pytest.approx(kept_f.expert_s, rel=1e-12)
  assert kept_f.a2a_s < plain_f.a2a_s


def test_fsep_without_remat_keeps_no_moe_buffers_but_the_kept_exchange():
  """fsep's MoE layer is recomputed in its own backward pass with or without remat: without
  remat its forward keeps none of the layer's six buffers a row (two, the exchanged ones,
  with keeps_exchange), and the recompute's buffers are one layer's, in the backward's work."""
  from moejax.strategy.memory import activation_terms

  base = dict(tokens=8192, d_model=768, num_layers=12, vocab_size=50304, expert_rows=6 * 20480,
              act_bytes=2, groups=6)
  ep, fsep = activation_terms(**base), activation_terms(**base, remat_blocks=True)
  kept = activation_terms(**base, remat_blocks=True, keeps_exchange=True)
  assert ep["kept"] - fsep["kept"] == 6 * 6 * 20480 * 768 * 2
  assert kept["kept"] - fsep["kept"] == 2 * 6 * 20480 * 768 * 2
  assert fsep["work"] - ep["work"] == 6 * 20480 * 768 * 2
  assert kept["work"] - ep["work"] == 4 * 20480 * 768 * 2


def test_dense_first_blocks_run_on_the_whole_batch():
  """The dense first blocks run before the pipeline's ticks on the device's whole batch: their
  backward's scores do not shrink with the microbatches, and it comes after the groups' (whose
  kept inputs are gone): the peak is the larger of the two phases."""
  from moejax.strategy.memory import activation_bytes, activation_terms, attention_score_bytes

  base = dict(tokens=8192, d_model=768, num_layers=10, vocab_size=50304, expert_rows=4 * 20480,
              act_bytes=2, groups=4, remat=True, heads=12, seq_len=1024, attention_scores=True,
              loss_chunk=256, first_dense=2)
  score = attention_score_bytes(8192, 12, 1024, 2)
  one, four = activation_terms(**base), activation_terms(**base, microbatches=4, stretch=1.25)
  assert one["first"] == four["first"] == 20 * 768 * 8192 * 2 + 2 * score
  assert four["work"] < one["work"]                       # a group's backward is a microbatch's
  assert one["first_kept"] == 2 * 2 * 8192 * 768 * 2      # each first block's two inputs
  assert activation_bytes(**base, microbatches=4, stretch=1.25) == one["first_kept"] + one["first"]
  none = activation_terms(**dict(base, first_dense=0, num_layers=8))
  assert none["first"] == none["first_kept"] == 0 and none["work"] == one["work"]


def test_fsep_under_fsdp_counts_restored_layers_on_the_shards():
  """Under FSDP (data 4) fsep's restores keep the embed shards: the three live restored layers
  and their gradients are a quarter of a layer each, beside one layer gathered whole for the
  MoE layer; without FSDP they are whole. Pipeline stages keep every layer of a stage's
  restores (their backward differentiates through the forward's), on the shards as well."""
  kw = dict(layers=4, experts=8, d_model=4, d_ff=8, devices=4, slots_per_device=4,
            compute_bytes=2)
  layer = 4 * 3 * 4 * 8 * 2                          # one layer's restored slots, bf16 bytes
  whole = expert_bytes("fsep", **kw)
  shards = expert_bytes("fsep", **kw, param_shards=4)
  grads = 4 * 8 * 3 * 4 * 8 // 4 * FP32              # stored shards' fp32 gradients, no FSDP
  assert whole["transient"] == grads + 2 * 3 * layer
  assert shards["transient"] == grads / 4 + 2 * 3 * layer / 4 + layer
  staged = expert_bytes("fsep", **kw, param_shards=4, stages=2)
  assert staged["transient"] == grads / 4 + 2 * 4 * layer / 4 + layer
  assert expert_bytes("fsep", **kw, stages=2)["transient"] == grads + 2 * 4 * layer
