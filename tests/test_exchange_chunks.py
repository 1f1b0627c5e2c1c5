"""Chunked token exchange (moe.exchange_chunks = K): the layer on K independent token pieces
equals the reference when nothing drops, drops what K per-piece buffers drop, and in the
compiled program the pieces run in FasterMoE's order: a piece's dispatch waits for no other
piece's matmuls, its experts and its return for the previous piece's."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.aot.hlo import parse
from moejax.config import ConfigError, MoEConfig
from moejax.layout import capacity
from moejax.layout.tables import static_layout
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.harness import run_against_reference
from moejax.model.moe.layer import moe_apply
from moejax.model.moe.route import route
from tests import hlo as hlo_lib
from tests.moe_helpers import (
  GRAD_LEN,
  LOSS_LEN,
  Y_LEN,
  D,
  E,
  F,
  make_params,
  row,
)
from tests.numerics import assert_close, assert_trees_close

BATCH, SEQ, N = 8, 8, 4      # (2, 4, 1) mesh: 8 sources of 8 tokens, pieces of 4


def _setup(cf, capacity_mode, chunks, seed=3):
  mesh = mesh_of_shape((2, N, 1))
  layout = jax.device_put(static_layout(1, E, N), NamedSharding(mesh, P()))
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=cf, d_ff=F, capacity=capacity_mode,
                  exchange_chunks=chunks)
  x = jax.random.normal(jax.random.key(seed), (BATCH, SEQ, D))
  return mesh, row(layout), cfg, x


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
@pytest.mark.parametrize("capacity_mode", capacity.MODES)
def test_chunks_equal_the_reference_when_nothing_drops(capacity_mode):
  mesh, layout, cfg, x = _setup(8.0, capacity_mode, 2)
  run = run_against_reference(cfg, mesh, make_params(4), x, layout)
  assert run.dropped == 0
  assert_close(run.y, run.ref_y, Y_LEN, err_msg="y")
  assert_close(run.loss, run.ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(run.grads, run.ref_grads, GRAD_LEN)


@pytest.mark.slow   # with the fresh venv's install, over the 8-minute budget
@pytest.mark.parametrize("capacity_mode", capacity.MODES)
def test_each_piece_has_its_own_buffers(capacity_mode):
  """At a tight factor the layer drops exactly what buffers sized for 4-token pieces drop,
  piece by piece, summed."""
  mesh, layout, cfg, x = _setup(1.0, capacity_mode, 2)
  params = make_params(4)
  _, st = jax.jit(lambda p, x: moe_apply(p, x, layout, cfg, mesh))(params, x)
  expert_TxK = np.asarray(route(x.reshape(-1, D), params["router"], 2,
                                normalize_top_k=True).expert_TxK)
  slots, piece = E // N, SEQ // 2
  cap = capacity.rows(capacity_mode, piece, 2, N, slots, 1.0)
  expected = 0
  for start in range(0, len(expert_TxK), piece):     # sources are 8-token blocks, in order
    loads_1xS = np.bincount(expert_TxK[start:start + piece].ravel(), minlength=E)[None]
    expected += capacity.dropped(capacity_mode, loads_1xS, slots, cap)
  assert int(np.sum(st.dropped_W)) == expected > 0


@pytest.mark.slow   # over the 8-minute budget of the README test command: .ci/run's slow pass
def test_pieces_run_in_fastermoe_order():
  """The pooled layer (tiled XLA grouped matmul) in 2 pieces (named scopes exchange_chunk0/1):
  in the compiled program no exchange of piece 0 waits for a matmul of piece 1 and piece 1's
  dispatch waits for none of piece 0; as lowered, piece 1's return waits for piece 0's
  matmuls (the barriers of moejax.model.moe.chunks, which XLA:CPU drops when it compiles:
  on GPU they let piece 0's return run beside piece 1's experts)."""
  mesh, layout, cfg, x = _setup(2.0, "device", 2)
  params = make_params(4)
  lowered = jax.jit(lambda p, x: moe_apply(p, x, layout, cfg, mesh)[0]).lower(params, x)

  def compute_of(module, piece):
    def pred(ins):
      if f"exchange_chunk{piece}/" not in ins.line:
        return False
      if ins.opcode in ("dot", "convolution"):
        return True
      return any(hlo_lib.has_dot(module, c) for c in ins.callees)
    return pred

  def pieces(text):
    module = parse(text)
    body = next(module.by_name(c) for c, instrs in module.computations.items()
                if any(ins.opcode == "all-to-all" for ins in instrs))
    found = {}
    for piece in (0, 1):
      found[piece] = [n for n, ins in body.items() if ins.opcode == "all-to-all"
                      and f"exchange_chunk{piece}/" in ins.line]
      assert len(found[piece]) >= 2, f"piece {piece}: {found[piece]}"   # there and back
      assert any(compute_of(module, piece)(ins) for ins in body.values()), piece
    return module, body, found

  module, body, found = pieces(lowered.compile().as_text())
  own = [n for n in found[1] if hlo_lib.depends_on(body, n, compute_of(module, 1))]
  dispatches = [n for n in found[1] if n not in own]
  assert own and dispatches, found[1]
  for name, other in [(n, 1) for n in found[0]] + [(n, 0) for n in dispatches]:
    waits = hlo_lib.depends_on(body, name, compute_of(module, other))
    assert waits is None, f"{name} waits for piece {other}: {waits.line}"
  module, body, found = pieces(lowered.as_text(dialect="hlo", debug_info=True))
  returns = [n for n in found[1] if hlo_lib.depends_on(body, n, compute_of(module, 1))]
  assert returns, found[1]
  for name in returns:
    assert hlo_lib.depends_on(body, name, compute_of(module, 0)), f"piece 1's {name} unordered"


@pytest.mark.slow     # 12 s on the 2-core VM: over the README test command's 8-minute budget
def test_pieces_must_divide_the_tokens():
  mesh, layout, cfg, x = _setup(2.0, "slot", 3)
  with pytest.raises(ConfigError, match="exchange_chunks=3 does not divide the 8 tokens"):
    moe_apply(make_params(4), x, layout, cfg, mesh)
