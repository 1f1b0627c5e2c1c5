"""Side-by-side runs: threads that take turns, one step each (`python -m
benchmarks.strategy.strategy_switch` times each run over its own turns). A library for the
studies, not a study itself."""

from __future__ import annotations

import threading


class Turns:
  """Runs that train side by side take turns, one step each: a slow spell of a shared machine
  then hits every run alike instead of whichever ran during it."""

  def __init__(self, order: list[int]):
    self.order, self.done = order, set()
    self.at = 0
    self.cond = threading.Condition()

  def wait(self, me: int) -> None:
    with self.cond:
      self.cond.wait_for(lambda: self.order[self.at] == me)

  def pass_on(self, me: int, finished: bool = False) -> None:
    """Ends `me`'s turn (the next run not finished takes it); `finished`: `me` leaves the
    rotation, from its turn or, failing before it, from anywhere."""
    with self.cond:
      if me in self.done:
        return
      holding = self.order[self.at] == me
      if finished:
        self.done.add(me)
      if holding and len(self.done) < len(self.order):
        self.at = (self.at + 1) % len(self.order)
        while self.order[self.at] in self.done:
          self.at = (self.at + 1) % len(self.order)
      self.cond.notify_all()


def side_by_side(jobs: list) -> list[dict]:
  """Runs `jobs` (callables of (turns, me)) in threads that take turns one step each, in the
  list's order; re-raises the first failure."""
  turns = Turns(list(range(len(jobs))))
  out: list = [None] * len(jobs)

  def go(i):
    try:
      out[i] = jobs[i](turns, i)
    except BaseException as e:   # handed to the main thread below
      out[i] = e
    finally:
      turns.pass_on(i, finished=True)   # a no-op for a job that already left the rotation

  threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for r in out:
    if isinstance(r, BaseException):
      raise r
  return out
