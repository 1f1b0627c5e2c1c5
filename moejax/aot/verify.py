"""`moejax.plan --verify K`: the offline stage's top K candidates compiled by XLA:GPU for the
profile's GPU and device count, beside the cost model's prediction: XLA's peak memory per
GPU against the arithmetic memory model, and the schedule's step estimate against the cost
model's step, with each model's error."""

from __future__ import annotations

from moejax.aot.compile import compile_train_step
from moejax.aot.summary import summarize
from moejax.config import Config, ConfigError
from moejax.strategy.offline import best_rows


def topology_for(devices: int) -> str:
  """Hosts of 8 GPUs (fewer devices: one host of that many)."""
  if devices <= 8:
    return f"1x1x{devices}"
  if devices % 8:
    raise ConfigError(f"--devices={devices}: a multi-host GPU topology needs a multiple of 8 "
                      "GPUs (8 per host).")
  return f"{devices // 8}x1x8"


def gpu_of(profile_name: str) -> str:
  return "h200" if "h200" in profile_name.lower() else "h100"


def verify(cfg: Config, rows: list, k: int, regime: str, max_drop: float, profile_name: str,
           devices: int, out=print) -> list[dict]:
  """Compiles the best `k` valid rows (by `regime`'s score) and prints one line each as it
  goes; returns the rows' numbers."""
  if k < 1:
    raise ConfigError(f"--verify={k} must be >= 1 (candidates to compile).")
  gpu, topology = gpu_of(profile_name), topology_for(devices)
  ok = best_rows(rows, regime, max_drop)
  out(f"verify: top {min(k, len(ok))} compiled by XLA:GPU for {topology} {gpu} "
      f"(the {regime} regime's prediction)")
  out(f"{'strategy':<28}{'model GiB':>10}{'XLA GiB':>9}{'mem err':>8}{'model ms':>10}"
      f"{'sched ms':>10}{'err':>7}{'compile s':>11}  fits")
  found = []
  for r in ok[:k]:
    cost = r.costs[regime]
    try:
      s = summarize(compile_train_step(cfg, r.strategy, gpu=gpu, topology=topology))
    except Exception as e:   # noqa: BLE001  (a candidate XLA cannot compile says why)
      out(f"{r.strategy.spec:<28}  not compiled: {type(e).__name__}: {str(e)[:120]}")
      continue
    mem_err = cost.memory_bytes / s["peak_bytes"] - 1
    step_err = cost.total_s / s["step_s"] - 1
    out(f"{r.strategy.spec:<28}{cost.memory_bytes / 2**30:10.2f}{s['peak_bytes'] / 2**30:9.2f}"
        f"{mem_err:+8.1%}{cost.total_s * 1e3:10.1f}{s['step_s'] * 1e3:10.1f}{step_err:7.0%}"
        f"{s['compile_s']:11.0f}  {'yes' if s['fits'] else 'NO: does not fit'}")
    found.append({"strategy": r.strategy.spec, "model_memory_bytes": cost.memory_bytes,
                  "model_step_s": cost.total_s, "memory_model_error": mem_err,
                  "step_error": step_err, **s})
  if found:
    mean = lambda key: sum(abs(f[key]) for f in found) / len(found)
    out(f"mean |error|: memory model {mean('memory_model_error'):.1%}, cost model vs schedule "
        f"{mean('step_error'):.0%}")
  best = fastest(found)
  if best:
    out(f"fastest compiled program that fits: {best['strategy']}, {best['step_s'] * 1e3:.1f} ms "
        f"a step by the schedule estimate (the cost model's first: {ok[0].strategy.spec})")
  return found


def fastest(found: list[dict]) -> dict | None:
  """The compiled candidate that fits with the shortest schedule estimate (None: none does):
  among candidates the cost model puts within its error of each other, the program decides."""
  return min((f for f in found if f.get("compiled") and f["fits"]), key=lambda f: f["step_s"],
             default=None)
