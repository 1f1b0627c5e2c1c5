"""Chunked token exchange (`moe.exchange_chunks = K`), FasterMoE's schedule.

A device's T routed tokens are cut into K contiguous pieces of T/K and each piece runs the
whole dispatch -> experts -> combine pipeline on its own, with the capacity of T/K tokens.
The pieces share no data, so in the compiled program piece i+1's all_to_all does not wait
for piece i's expert matmuls and the scheduler may overlap them. The loop over pieces is
unrolled on purpose: a scan would put one piece per iteration and serialise them.

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


def chunked(pipeline, pieces: int):
  """`pipeline` (x_TxD, slot_TK, gate_TxK, ...) -> (y_TxD, dropped, slot_counts_S, kept_S) run
  on `pieces` independent token pieces; same signature and results summed over pieces."""
  def run(x_TxD, slot_TK, gate_TxK, *rest):
    t = x_TxD.shape[0] // pieces
    choices = t * gate_TxK.shape[1]
    outs = []
    for i in range(pieces):
      with jax.named_scope(f"exchange_chunk{i}"):
        outs.append(pipeline(x_TxD[i * t:(i + 1) * t], slot_TK[i * choices:(i + 1) * choices],
                             gate_TxK[i * t:(i + 1) * t], *rest))
    y_TxD = jnp.concatenate([o[0] for o in outs], axis=0)
    return (y_TxD, *(sum(o[j] for o in outs) for j in (1, 2, 3)))
  return run
