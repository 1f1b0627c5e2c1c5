"""Fit a HardwareProfile to this machine by micro-benchmarks on all its devices.

`python -m moejax.calibrate --out profile.json` times, on every local device at
once (so contention is in the numbers): matmuls (FLOP/s), an elementwise op
(bytes/s), and all_to_all and psum over groups of 2..N devices (latency per call,
its growth with the group size, and bandwidth). Each constant is a least-squares
fit of time = fixed + work / rate over a few sizes. `moejax.plan --profile
profile.json` and the trainer's strategy switching use the result.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.strategy.cost import HardwareProfile


def _fastest_s(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))            # compile + warm
  times = []
  for _ in range(repeats):
    tick = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - tick)
  return float(np.min(times))   # the machine may be shared: contention only adds time


def _fit(work: list[float], seconds: list[float]) -> tuple[float, float]:
  """seconds = fixed + work / rate  ->  (fixed, rate); both kept positive."""
  a = np.stack([np.ones(len(work)), np.asarray(work, np.float64)], 1)
  (fixed, per), *_ = np.linalg.lstsq(a, np.asarray(seconds, np.float64), rcond=None)
  if per <= 0:                                  # noise: fall back to the largest size alone
    per, fixed = seconds[-1] / work[-1], 0.0
  return max(float(fixed), 0.0), 1.0 / float(per)


def _mesh(devices, group: int) -> jax.sharding.Mesh:
  return jax.make_mesh((len(devices) // group, group), ("rest", "g"), devices=devices)


def _per_device(mesh, shape, dtype=jnp.float32, seed=0) -> jax.Array:
  full = (mesh.size * shape[0],) + tuple(shape[1:])
  x = jax.random.normal(jax.random.key(seed), full, dtype)
  return jax.device_put(x, NamedSharding(mesh, P(("rest", "g"))))


def matmul_rate(devices, repeats: int, sizes=((256, 256, 256), (512, 256, 512),
                                               (512, 512, 1024))) -> float:
  mesh = _mesh(devices, 1)
  work, secs = [], []
  for t, d, f in sizes:
    x = _per_device(mesh, (t, d))
    w = jax.device_put(jnp.ones((d, f), jnp.float32) / d, NamedSharding(mesh, P()))
    fn = jax.jit(jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P(("rest", "g")), P()),
                               out_specs=P(("rest", "g"))))
    work.append(2.0 * t * d * f)
    secs.append(_fastest_s(fn, x, w, repeats=repeats))
  return _fit(work, secs)[1]


def memory_rate(devices, repeats: int, sizes=(2**16, 2**18, 2**20)) -> tuple[float, float]:
  """(fixed seconds per launch, bytes/s of an elementwise read + write)."""
  mesh = _mesh(devices, 1)
  work, secs = [], []
  for n in sizes:
    x = _per_device(mesh, (n,))
    fn = jax.jit(jax.shard_map(lambda a: a * 1.0001 + 0.5, mesh=mesh,
                               in_specs=P(("rest", "g")), out_specs=P(("rest", "g"))))
    work.append(8.0 * n)
    secs.append(_fastest_s(fn, x, repeats=repeats))
  return _fit(work, secs)


def collective(devices, kind: str, repeats: int, sizes=(2**12, 2**15, 2**18)):
  """[(group size, fixed seconds per call, bytes/s)] for all_to_all or psum over groups."""
  out = []
  groups = [g for g in (2, 4, 8, 16, 32) if g <= len(devices) and len(devices) % g == 0]
  for g in groups:
    mesh = _mesh(devices, g)
    work, secs = [], []
    for n in sizes:
      rows = max(g, n // g * g)
      x = _per_device(mesh, (rows, 1))
      if kind == "all_to_all":
        body = lambda a, g=g: jax.lax.all_to_all(a.reshape(g, -1, 1), "g", 0, 0).reshape(
            a.shape)
      else:
        body = lambda a: jax.lax.psum(a, "g")
      fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("rest", "g")),
                                 out_specs=P(("rest", "g"))))
      work.append(4.0 * rows * (g - 1) / g)      # bytes a device sends (per direction)
      secs.append(_fastest_s(fn, x, repeats=repeats))
    out.append((g, *_fit(work, secs)))
  return out


def calibrate(devices=None, repeats: int = 15, name: str | None = None) -> HardwareProfile:
  devices = list(jax.devices() if devices is None else devices)
  flops = matmul_rate(devices, repeats)
  launch_s, mem = memory_rate(devices, repeats)
  a2a = collective(devices, "all_to_all", repeats)
  red = collective(devices, "psum", repeats)
  # Latency per call grows with the group: fit fixed = base + per_device * g over all groups.
  g = np.array([r[0] for r in a2a + red], np.float64)
  fixed = np.array([r[1] for r in a2a + red], np.float64)
  (base, per_dev), *_ = np.linalg.lstsq(np.stack([np.ones_like(g), g], 1), fixed, rcond=None)
  platform = devices[0].platform
  return HardwareProfile(
      name=name or f"calibrated:{socket.gethostname()}:{platform}x{len(devices)}",
      flops_per_s=flops, mem_bytes_per_s=mem,
      a2a_bytes_per_s=float(np.median([r[2] for r in a2a])) if a2a else 1e12,
      reduce_bytes_per_s=float(np.median([r[2] for r in red])) if red else 1e12,
      latency_s=max(float(base), 0.0), latency_per_device_s=max(float(per_dev), 0.0),
      overhead_s=launch_s, memory_bytes=_device_memory(devices[0]))


def fit_steps(profile: HardwareProfile, costs: list, measured_s: list[float]) -> HardwareProfile:
  """Fit the whole-step scales: measured = a * (compute terms) + b * (collectives but tensor
  parallel) + t * (tensor-parallel psums) + c, non-negative least squares over calibration
  strategies' StepCosts predicted with `profile` (scales 1). A term no calibration strategy
  has (e.g. no model axis) is not fitted: t then follows b, a and b stay 1."""
  cols = {"overhead_s": [1.0] * len(costs),   # in the order they are kept with few points
          "compute_scale": [c.compute_s + c.expert_s + c.memory_s for c in costs],
          "comm_scale": [c.a2a_s + c.restore_s + c.reduce_s + c.pipe_s for c in costs],
          "tp_scale": [c.tp_s for c in costs]}
  y = np.asarray(measured_s, np.float64)
  active = [k for k, v in cols.items() if np.max(np.abs(v)) > 0]
  active = active[:max(1, len(y) - 1)]          # keep at least one residual degree of freedom
  while True:                                   # tiny active-set non-negative least squares
    a = np.stack([np.asarray(cols[k], np.float64) for k in active], 1)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if np.all(coef >= 0) or len(active) == 1:
      break
    active.pop(int(np.argmin(coef)))
  fit = {k: float(max(v, 0.0)) for k, v in zip(active, coef)}
  comm = fit.get("comm_scale", 1.0)
  return dataclasses.replace(profile, compute_scale=fit.get("compute_scale", 1.0),
                             comm_scale=comm, tp_scale=fit.get("tp_scale", comm),
                             overhead_s=fit.get("overhead_s", 0.0))


def _device_memory(device) -> float:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  return 8.0 * 2**30                              # host devices: a conservative default


def save(profile: HardwareProfile, path: str) -> None:
  with open(path, "w") as f:
    json.dump(profile.to_dict(), f, indent=2)
