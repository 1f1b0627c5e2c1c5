"""Keeping a MoE layer's exchanged buffers for a backward pass that recomputes the layer.

fsep's MoE layer is recomputed in its own backward pass (moejax.model.moe.fsep_backward), not
by the layer group's checkpoint, so a remat policy naming the exchanges cannot keep them. A
`Tape` does it by hand, at trace time: the forward runs the layer with a recording tape and
keeps what every exchange returned; the backward's recompute runs it with a replaying tape,
on which each exchange returns its kept value (no communication) and its transpose still
carries the cotangent back (one all_to_all, as before). The exchanges are taken in the order
the pipeline makes them, the same in both runs (the pipeline is built once per config).

`dispatch.exchange` and `dispatch.exchange_counts` consult the innermost tape (`current`).
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax

_TAPES: list[Tape] = []      # innermost last; only while a layer is being traced


class Tape:
  """The exchanged buffers of one trace of a MoE layer's pipeline (inside its shard_map):
  `recorded` when recording; consumed in order from `kept` when replaying."""

  def __init__(self, kept: tuple | None = None):
    self.recorded: list[jax.Array] = []
    self._kept = None if kept is None else list(kept)

  @property
  def replaying(self) -> bool:
    return self._kept is not None

  def record(self, value: jax.Array) -> jax.Array:
    """`value` (an exchange's output), recorded when recording."""
    if not self.replaying:
      self.recorded.append(value)
    return value

  @property
  def unread(self) -> int:
    return len(self._kept or ())

  def next_kept(self) -> jax.Array:
    if not self._kept:
      raise RuntimeError("the MoE layer's recompute makes more exchanges than its forward "
                         "recorded: the pipeline must be the same in both runs")
    return self._kept.pop(0)


@contextlib.contextmanager
def taping(kept: tuple | None = None):
  """A tape for the exchanges traced inside the block: recording, or replaying `kept`."""
  tape = Tape(kept)
  _TAPES.append(tape)
  try:
    yield tape
  finally:
    _TAPES.pop()
  if tape.unread:
    raise RuntimeError(f"the MoE layer's recompute left {tape.unread} kept exchanges "
                       "unread: the pipeline must be the same in both runs")


def current() -> Tape | None:
  return _TAPES[-1] if _TAPES else None


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def replayed(buf_rowsxD: jax.Array, kept_rowsxD: jax.Array, transpose) -> jax.Array:
  """`kept_rowsxD`, the value `exchange(buf_rowsxD)` had in the forward, whose cotangent goes
  back to `buf_rowsxD` as `transpose(ct, like_buf)` says (the exchange's transpose, typed as
  the cotangent of an input varying like `like_buf`)."""
  del buf_rowsxD, transpose
  return kept_rowsxD


def _replayed_fwd(buf_rowsxD, kept_rowsxD, transpose):
  del transpose
  return kept_rowsxD, buf_rowsxD[:0]     # a zero-size slice: buf's dtype and varying axes


def _replayed_bwd(transpose, like_buf, ct_rowsxD):
  return transpose(ct_rowsxD, like_buf), None


replayed.defvjp(_replayed_fwd, _replayed_bwd)
