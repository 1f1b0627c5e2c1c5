"""Chunked token exchange (`moe.exchange_chunks = K`), FasterMoE's schedule.

A device's T routed tokens are cut into K contiguous pieces of T/K and each piece runs the
whole dispatch -> experts -> combine pipeline on its own, with the capacity of T/K tokens.
The loop over pieces is unrolled on purpose: a scan would put one piece per iteration and
serialise them.

Independent pieces are not enough for XLA:GPU to overlap them: its dot merger fuses the
pieces' expert matmuls that share a weight into one matmul, so no piece's return exchange
can start before every piece's experts have run, and the latency-hiding scheduler then has
nothing of another piece to put under it (docs/decisions/0101). So a pipeline is written
as stages (`whole` lists them) and `chunked` orders the pieces through optimization
barriers, FasterMoE's pipeline: piece i's experts after piece i-1's, and beside piece
i-1's return exchange; piece i's return after piece i-1's. Every piece's dispatch is free
to start at once. The barriers are identities: values and gradients are unchanged.

What changes: capacity is per piece, so under skew a piece may drop a choice that one
buffer for all T tokens would have kept (and the reverse); drops are counted per piece and
summed. Routing, the balance loss and the realised-load counts stay over all T tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_error(num_tokens: int, pieces: int) -> str | None:
  """Why `num_tokens` per device cannot be cut into `pieces`, or None."""
  if num_tokens % pieces:
    return (f"moe.exchange_chunks={pieces} does not divide the {num_tokens} tokens each device "
            "routes (batch per device x sequence length); use a divisor of it.")
  return None


def whole(stages):
  """Runs a pipeline's stages (a generator) as one piece and returns its results. The
  generator yields, in order, its experts' input rows (after the dispatch exchange), its
  experts' output rows (before the return exchange) and the returned rows, and goes on
  with the value it is sent for each (the same rows, possibly through a barrier)."""
  rows = next(stages)
  try:
    while True:
      rows = stages.send(rows)
  except StopIteration as stop:
    return stop.value


def _finish(stages, rows):
  try:
    stages.send(rows)
  except StopIteration as stop:
    return stop.value
  raise RuntimeError("a pipeline's stages yield three times: expert input, output, returned")


def chunked(pipeline, pieces: int):
  """`pipeline` (x_TxD, slot_TK, gate_TxK, ...) -> stages of (y_TxD, dropped, slot_counts_S,
  kept_S), run on `pieces` token pieces in FasterMoE's order; returns the pipeline's results
  (not stages), y concatenated and the counts summed over pieces."""
  def run(x_TxD, slot_TK, gate_TxK, *rest):
    t = x_TxD.shape[0] // pieces
    choices = t * gate_TxK.shape[1]
    gens, recv = [], []
    for i in range(pieces):
      with jax.named_scope(f"exchange_chunk{i}"):
        gens.append(pipeline(x_TxD[i * t:(i + 1) * t], slot_TK[i * choices:(i + 1) * choices],
                             gate_TxK[i * t:(i + 1) * t], *rest))
        recv.append(next(gens[i]))
    outs, results = [None] * pieces, [None] * pieces
    for i in range(pieces + 1):
      if 0 < i < pieces:      # piece i's experts wait for piece i-1's: they run beside its return
        recv[i], outs[i - 1] = jax.lax.optimization_barrier((recv[i], outs[i - 1]))
      if i < pieces:
        with jax.named_scope(f"exchange_chunk{i}"):
          outs[i] = gens[i].send(recv[i])
      if i:
        with jax.named_scope(f"exchange_chunk{i - 1}"):
          back = gens[i - 1].send(outs[i - 1])
        if i < pieces:        # piece i's return after piece i-1's
          outs[i], back = jax.lax.optimization_barrier((outs[i], back))
        with jax.named_scope(f"exchange_chunk{i - 1}"):
          results[i - 1] = _finish(gens[i - 1], back)
    y_TxD = jnp.concatenate([r[0] for r in results], axis=0)
    return (y_TxD, *(sum(r[j] for r in results) for j in (1, 2, 3)))
  return run
