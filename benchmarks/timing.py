"""Timing and table helpers for the benchmarks (kernel sweeps, layer times)."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np


def median_seconds(fn, *args, iters: int = 5) -> float:
  """Median wall time of `fn(*args)` after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def max_abs_diff(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


def platform_note() -> str:
  dev = jax.devices()[0]
  note = f"jax {jax.__version__} on {dev.platform} ({dev.device_kind})"
  if dev.platform == "cpu":
    note += ": Pallas INTERPRET mode, timings measure the interpreter, not a kernel"
  return note


def print_table(rows: list[dict], columns: list[str]) -> None:
  widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for r in rows:
    print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.3g}"
  return "" if v is None else str(v)
