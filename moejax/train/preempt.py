"""Preemption: SIGTERM / SIGINT ask the loop to finish the step, save and exit 0.

The handlers only set a flag. `poll()` is called once per step by every process; in a
multi-process run it turns the local flags into one decision that all processes reach at the
same step: each poll dispatches a tiny max-reduction of the flags over all devices and returns
the result of the previous poll's (ready by then, as the previous step has finished), so
processes that got the signal at different steps still stop together, one step later. A second
signal restores the previous handlers and re-raises it (Ctrl-C twice: stop now).
JAX is imported only by `poll`, so train.py can install the handlers before JAX starts.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jax.sharding import Mesh

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
  """Context manager: installs the handlers; `poll()` says when to stop (same step everywhere).
  Enter it as early as possible (train.py does, before JAX starts): a signal that arrives
  during start-up then stops the run after its first step instead of killing it."""

  def __init__(self):
    self.signal_name: str | None = None
    self._previous: dict = {}
    self._pending = None
    self._reduce = None

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():   # signals: main thread only
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    self._restore()

  def reinstall(self) -> None:
    """Takes the signals back from whatever took them since (`jax.distributed.initialize`
    installs JAX's own SIGTERM notifier, unseen by Python)."""
    if self._previous:
      for s in SIGNALS:
        signal.signal(s, self._handle)

  def _restore(self) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    if self.signal_name is not None:   # the second signal: give it to the previous handler
      self._restore()
      signal.raise_signal(signum)
      return
    self.signal_name = signal.Signals(signum).name

  def poll(self, mesh: Mesh) -> bool:
    """True when the run should stop after the step just dispatched (call once per step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    local = self.signal_name is not None
    if jax.process_count() == 1:
      return local
    if self._reduce is None:
      self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
    flags = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(mesh.axis_names)),
        np.full((len(mesh.local_devices),), local), (mesh.size,))
    previous, self._pending = self._pending, self._reduce(flags)
    return previous is not None and bool(previous)
