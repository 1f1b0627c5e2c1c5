"""Numerical faults: steps with a non-finite loss or gradient are skipped by the train step;
this counts them and stops the run after too many in a row (host-side, JAX-free)."""

from __future__ import annotations


class NonFiniteError(RuntimeError):
  """Too many consecutive non-finite steps; the message is one line with what to do."""


class NonFiniteGuard:
  """Counts skipped steps (saved in checkpoints, so a resumed run stops where it would have)."""

  def __init__(self, max_consecutive: int):
    self.max_consecutive = max_consecutive
    self.consecutive = 0
    self.total = 0

  def observe(self, step: int, skipped: bool) -> bool:
    """Records one finished step; True when `max_consecutive` steps in a row were skipped."""
    if not skipped:
      self.consecutive = 0
      return False
    self.consecutive += 1
    self.total += 1
    return self.consecutive >= self.max_consecutive

  def error(self, step: int, last_checkpoint: str) -> NonFiniteError:
    first = step - self.consecutive + 1
    return NonFiniteError(
        f"steps {first}..{step}: {self.consecutive} consecutive steps had a non-finite loss or "
        f"gradient and were skipped (train.max_consecutive_nonfinite={self.max_consecutive}); "
        f"stopped without saving, the last good checkpoint is {last_checkpoint}; lower "
        "optim.learning_rate or check the data, then re-run the same command.")

  def state_dict(self) -> dict:
    return {"consecutive": self.consecutive, "total": self.total}

  def load_state_dict(self, d: dict) -> None:
    self.consecutive = int(d.get("consecutive", 0))
    self.total = int(d.get("total", 0))
