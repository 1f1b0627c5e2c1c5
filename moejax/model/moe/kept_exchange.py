"""Keeping what a MoE layer's recompute would otherwise communicate again, for a backward pass
that recomputes the layer.

fsep's MoE layer is recomputed in its own backward pass (moejax.model.moe.fsep_backward), not
by the layer group's checkpoint, so a remat policy naming values cannot keep them. A `Tape`
does it by hand, at trace time: the forward runs the layer with a recording tape and keeps
what it names; the backward's recompute runs it with a replaying tape, which hands the kept
values back in the order they were recorded (the pipeline is built once per config, so both
runs take them in the same order). Two kinds of value:

  shares     the balance loss's global shares of choices per expert (moejax.model.moe.route),
             a psum over the token axes; kept wherever the softmax gate computes them: [E]
             floats a layer, read by the loss through a stop_gradient, so the recompute
             needs no cotangent for them.
  exchanges  what every token exchange returned (with `exchanges=True`): no exchange and no
             down projection recomputed; each exchange's transpose still carries the cotangent
             back (one all_to_all, as before).

`dispatch.exchange`, `dispatch.exchange_counts` and `route` consult the innermost tape
(`current`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax

_TAPES: list[Tape] = []      # innermost last; only while a layer is being traced


class Kept(NamedTuple):
  """What a recording tape kept: the exchanges' outputs (every device's rows along the first
  axis; empty where the tape kept none) and the shares (each the same on every device)."""
  exchanges: tuple
  shares: tuple


class _Queue:
  """Values of one kind: recorded in order, or handed back in that order."""

  def __init__(self, kept: tuple | None, name: str):
    self.recorded: list[jax.Array] = []
    self._kept = None if kept is None else list(kept)
    self._name = name

  @property
  def replaying(self) -> bool:
    return self._kept is not None

  @property
  def unread(self) -> int:
    return len(self._kept or ())

  def record(self, value: jax.Array) -> jax.Array:
    if not self.replaying:
      self.recorded.append(value)
    return value

  def next_kept(self) -> jax.Array:
    if not self._kept:
      raise RuntimeError(f"the MoE layer's recompute makes more {self._name} than its forward "
                         "recorded: the pipeline must be the same in both runs")
    return self._kept.pop(0)


class Tape:
  """The kept values of one trace of a MoE layer's pipeline (inside its shard_map): recording
  (`kept` None; the exchanges too with `exchanges`), or replaying a `Kept`, whose exchanges
  are replayed where it holds any."""

  def __init__(self, kept: Kept | None = None, exchanges: bool = False):
    replay = kept is not None
    self.keeps_exchanges = bool(kept.exchanges) if replay else exchanges
    self._exchanges = _Queue(kept.exchanges if replay and self.keeps_exchanges else None,
                             "exchanges")
    self._shares = _Queue(kept.shares if replay else None, "balance-loss shares")

  @property
  def replaying(self) -> bool:
    """Whether the exchanges are replayed (the shares are whenever the tape replays)."""
    return self._exchanges.replaying

  def record(self, value: jax.Array) -> jax.Array:
    """`value` (an exchange's output), recorded where the tape keeps exchanges."""
    return self._exchanges.record(value) if self.keeps_exchanges else value

  def next_kept(self) -> jax.Array:
    return self._exchanges.next_kept()

  def shares(self, compute: Callable[[], jax.Array]) -> jax.Array:
    """The balance loss's shares: the kept value when replaying, else `compute()`, recorded."""
    if self._shares.replaying:
      return self._shares.next_kept()
    return self._shares.record(compute())

  def kept(self) -> Kept:
    """What this (recording) tape kept."""
    return Kept(tuple(self._exchanges.recorded), tuple(self._shares.recorded))

  @property
  def unread(self) -> int:
    return self._exchanges.unread + self._shares.unread


@contextlib.contextmanager
def taping(kept: Kept | None = None, exchanges: bool = False):
  """A tape for the values traced inside the block: recording (the exchanges too with
  `exchanges`), or replaying `kept`."""
  tape = Tape(kept, exchanges)
  _TAPES.append(tape)
  try:
    yield tape
  finally:
    _TAPES.pop()
  if tape.unread:
    raise RuntimeError(f"the MoE layer's recompute left {tape.unread} kept values unread: "
                       "the pipeline must be the same in both runs")


def current() -> Tape | None:
  return _TAPES[-1] if _TAPES else None


def shares(compute: Callable[[], jax.Array]) -> jax.Array:
  """The balance loss's global shares per expert: `compute()` (a psum), or under a tape its
  kept value (`Tape.shares`)."""
  tape = current()
  return compute() if tape is None else tape.shares(compute)


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
