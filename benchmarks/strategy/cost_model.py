"""Cost-model accuracy: predicted vs measured train-step time of every pool member.

    python -m benchmarks.strategy.cost_model [--gin_file F] [--pool SPEC ...] [--rounds 3]
        [--steps 5]

    python -m benchmarks.strategy.cost_model --gin_bindings="moe.capacity = 'slot'" \
      --gin_bindings="moe.moe_every = 1" --pool ep/1x4x1/p2/m2/cf1.25 ...

`main`'s docstring says how.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import time

import jax
import numpy as np

from benchmarks.common import command, metadata, start, write_result
from benchmarks.strategy import RESULTS
from moejax.frontend import DEFAULT_GIN, parse_config
from moejax.strategy import offline as plan
from moejax.strategy.cost import PRESETS, HardwareProfile, predict_step
from moejax.strategy.profile_fit import calibrate, fit_steps
from moejax.strategy.spec import parse
from moejax.strategy.switcher import expert_shares
from moejax.train.data import BatchLoader, load_tokens
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import build_program
from moejax.train.state import init_state


def calibration_strategies(rows, pool, k: int) -> list:
  """k valid strategies that share no mode and mesh with a pool member (the fit is judged on
  programs unlike any it saw; a pool member's mesh at another capacity would be close), taken
  in turn from each kind (mode, with/without expert axis, with/without model axis) so every
  fitted term is seen, each kind's picks spread over its predicted time range."""
  def program_kind(s):
    return s.expert_mode, s.data, s.expert, s.model

  taken = {program_kind(s) for s in pool}
  kinds: dict = {}
  for r in sorted((r for r in rows if r.rejected is None and _plain(r.strategy) and
                   program_kind(r.strategy) not in taken),
                  key=lambda r: r.costs["uniform"].total_s):
    s = r.strategy
    kinds.setdefault((s.expert_mode, s.expert > 1, s.model > 1), []).append(s)
  order = [0.5, 0.0, 1.0, 0.25, 0.75]            # median first, then the ends, then between
  picks: list = []
  for frac in order * k:
    for group in kinds.values():
      s = group[int(round(frac * (len(group) - 1)))]
      if len(picks) < k and s not in picks:
        picks.append(s)
  return picks


def _plain(s) -> bool:
  """No pipeline, no microbatches, no FSDP: the fit never sees the terms those add, so the
  pipeline members' errors test the bubble and stage terms, not a fit to them."""
  return s.stage == 1 and s.microbatches == 1 and not s.fsdp


def bubble_table(out: list[dict]) -> list[dict]:
  """Pool members that differ only in M, side by side: step time over the smallest M's,
  measured and predicted (the bubble shrinks as M grows; per-tick costs grow)."""
  groups: dict = {}
  for o in out:
    if o["role"] == "pool":
      s = parse(o["strategy"])
      groups.setdefault(dataclasses.replace(s, microbatches=1), []).append((s.microbatches, o))
  rows = []
  for key, members in groups.items():
    members.sort(key=lambda mo: mo[0])
    m0, base = members[0]
    for mb, o in members:
      rows.append({"strategy": o["strategy"], "stages": key.stage, "microbatches": mb,
                   "bubble": o["predicted"]["bubble"],
                   "measured_ratio": o["measured_s"] / base["measured_s"],
                   "predicted_ratio": o["predicted"]["total_s"] / base["predicted"]["total_s"],
                   "vs_microbatches": m0})
  return rows


def evaluate(profile, w, members: list[dict]) -> dict:
  """Fits the whole-step scales on the "fit" members (strategy, measured seconds, expert
  shares), predicts every member, prints the table; the result's profile, members and MAPEs."""
  fit_members = [m for m in members if m["role"] == "fit"]
  fitted = fit_steps(profile, [predict_step(m["strategy"], w, profile, m["share"])
                               for m in fit_members], [m["measured"] for m in fit_members])
  print(f"whole-step fit on {len(fit_members)} calibration strategies: compute x"
        f"{fitted.compute_scale:.2f}, collectives x{fitted.comm_scale:.2f}, tensor-parallel "
        f"psums x{fitted.tp_scale:.2f}, fixed {fitted.overhead_s * 1e3:.1f} ms")
  out, errors, errors_micro, errors_preset = [], [], [], []
  print(f"\n{'strategy':<28}{'role':>7}{'measured ms':>13}{'predicted ms':>14}{'error':>9}"
        f"{'micro only':>12}{'cpu preset':>12}{'drop pred':>11}")
  for mem in members:
    s, measured, share, role = mem["strategy"], mem["measured"], mem["share"], mem["role"]
    pred = predict_step(s, w, fitted, share)
    micro = predict_step(s, w, profile, share)
    preset = predict_step(s, w, PRESETS["cpu"], share)
    err = (pred.total_s - measured) / measured
    if role == "pool":
      errors.append(abs(err))
      errors_micro.append(abs(micro.total_s - measured) / measured)
      errors_preset.append(abs(preset.total_s - measured) / measured)
    print(f"{s.spec:<28}{role:>7}{measured * 1e3:13.1f}{pred.total_s * 1e3:14.1f}{err:9.1%}"
          f"{micro.total_s * 1e3:12.1f}{preset.total_s * 1e3:12.1f}{pred.drop_fraction:11.2%}")
    out.append({"strategy": s.spec, "role": role, "measured_s": measured,
                "predicted": pred.to_dict(), "micro_only": micro.to_dict(),
                "micro_only_total_s": micro.total_s, "expert_share_LxE": np.asarray(share).tolist(),
                "cpu_preset_total_s": preset.total_s, "error": err})
  mape = float(np.mean(errors))
  mape_micro, mape_preset = float(np.mean(errors_micro)), float(np.mean(errors_preset))
  print(f"\npool MAPE: calibrated (micro-benchmarks + whole-step fit) {mape:.1%} (goal <= 10%);"
        f" micro-benchmarks only {mape_micro:.1%}; uncalibrated cpu preset {mape_preset:.1%}")
  bubble = bubble_table(out)
  if any(b["stages"] > 1 for b in bubble):
    print(f"\n{'strategy':<28}{'P':>3}{'M':>4}{'bubble':>8}{'measured / M0':>15}"
          f"{'predicted / M0':>16}")
    for b in bubble:
      print(f"{b['strategy']:<28}{b['stages']:>3}{b['microbatches']:>4}{b['bubble']:8.1%}"
            f"{b['measured_ratio']:15.3f}{b['predicted_ratio']:16.3f}")
  return {"profile": fitted.to_dict(), "members": out, "mape": mape,
          "mape_micro_only": mape_micro, "mape_cpu_preset": mape_preset, "bubble": bubble}


def refit(path: str, argv) -> int:
  """Re-fits and re-predicts a stored run from its own measurements (step times, expert
  shares, micro-benchmark profile) with the cost model as it is now; nothing is re-timed.
  The model and batch come from the stored command's gin flags."""
  with open(path) as f:
    stored = json.load(f)
  stored_command = stored["metadata"]["command"]
  words = shlex.split(stored_command)
  first = next(i for i, x in enumerate(words) if "cost_model" in x) + 1
  args = _parser().parse_args(words[first:])
  w = plan.workload_of(parse_config(args.gin_file or [DEFAULT_GIN], args.gin_bindings))
  profile = HardwareProfile(**stored["profile_micro"])
  members = [{"strategy": parse(m["strategy"]), "measured": m["measured_s"], "role": m["role"],
              "share": np.asarray(m["expert_share_LxE"])} for m in stored["members"]]
  print(f"refit of {path} ({stored_command}): {len(members)} stored step times")
  result = dict(stored, **evaluate(profile, w, members))
  result["refit"] = {"metadata": metadata(command("strategy.cost_model", argv)),
                     "mape_before": stored["mape"],
                     "note": "re-fitted and re-predicted from the stored measurements with "
                             "the cost model of this commit; no step was re-timed"}
  write_result(result, path, restamp=False)   # the metadata stays the timed run's
  return 0


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m benchmarks.strategy.cost_model",
                              description=__doc__.splitlines()[0])
  p.add_argument("--gin_file", action="append", default=None)
  p.add_argument("--gin_bindings", action="append", default=[])
  p.add_argument("--pool", nargs="*", default=None,
                 help="specs; default: the pool python -m moejax.plan picks")
  p.add_argument("--calib", type=int, default=6, help="calibration strategies for the fit")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--out", default=None)
  p.add_argument("--refit", default=None, metavar="JSON",
                 help="re-fit a stored result from its measurements (no timing) and rewrite it")
  return p


def main(argv=None) -> int:
  """1. Calibrates a hardware profile by micro-benchmarks on this machine's devices
     (`moejax.strategy.profile_fit`: matmul, elementwise, all_to_all and psum over 2..N devices).
  2. Picks the pool as `python -m moejax.plan` does, under that profile (or takes `--pool`).
  3. Compiles every member, then times train steps in interleaved rounds (fastest per
     member; the machine is shared, interleaving spreads its noise evenly).
  4. Fits the whole-step scales (`moejax.strategy.profile_fit.fit_steps`) on `--calib` other
     strategies of every kind (ep/fsep, with/without expert and model axes) timed the
     same way, then predicts each pool member (never seen by the fit) under the expert
     load its timed steps really had: error and MAPE, also for the micro-benchmarks
     alone and the uncalibrated preset. The fit sees no pipeline or FSDP strategy, so pool
     members with stages (`ep/1x4x1/p2/m4/cf1.25`) test the bubble and stage terms; members
     differing only in M are also compared side by side (step time over the smallest M's).
  Writes benchmarks/strategy/results/cost_model_<platform>.json (`--out` elsewhere). Default: 8 fake
  CPU devices. The pipeline run of the README:
  """
  args = _parser().parse_args(argv)
  if args.refit:
    return refit(args.refit, argv)
  cfg = parse_config(args.gin_file or [DEFAULT_GIN], args.gin_bindings)
  devices = jax.devices()

  tick = time.perf_counter()
  profile = calibrate(devices, repeats=9)
  calib_s = time.perf_counter() - tick
  rows = plan.rank(cfg, profile, len(devices))
  pool = [parse(s) for s in args.pool] if args.pool else plan.pick_pool(rows, 4, 0.01)
  calib = calibration_strategies(rows, pool, args.calib)
  print(f"micro-benchmarks in {calib_s:.1f}s: {profile}")
  print("pool: " + ", ".join(s.spec for s in pool))
  print("calibration strategies: " + ", ".join(s.spec for s in calib))

  tx, lr = optimizer(cfg.optim, 1000), schedule(cfg.optim, 1000)
  tokens, _, _ = load_tokens(cfg.data)
  loader = BatchLoader(tokens, cfg.data.seq_len, cfg.data.global_batch_size, cfg.data.seed)
  rows = [loader.next_local() for _ in range(args.steps)]
  members = []
  for s in calib + pool:
    prog = build_program(cfg, s, tx, lr, devices)
    state = init_state(prog.model, tx, prog.shardings, prog.layout,
                       cfg.data.global_batch_size, cfg.data.seq_len, 0)
    batches = [jax.device_put(r, prog.batch_sharding) for r in rows]
    members.append({"prog": prog, "state": state, "batches": batches, "times": [],
                    "counts": []})
  for _ in range(args.rounds + 1):            # the first round warms up and is not counted
    for mem in members:
      times = []
      for b in mem["batches"]:
        tick = time.perf_counter()
        mem["state"], m = mem["prog"].train_step(mem["state"], b, mem["prog"].layout)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - tick)
        mem["counts"].append(np.asarray(m["counts_LxWxE"]))
      mem["times"].append(times)

  w = plan.workload_of(cfg)
  for mem in members:
    mem["measured"] = float(np.min(np.concatenate(mem["times"][1:])))   # contention only adds
    mem["share"] = expert_shares(np.stack(mem["counts"]))
    mem["strategy"] = mem["prog"].strategy
  for i, mem in enumerate(members):
    mem["role"] = "fit" if i < len(calib) else "pool"
  result = {"device": f"{devices[0].platform} x{len(devices)} ({devices[0].device_kind})",
            "command": command("strategy.cost_model", argv), "profile_micro": profile.to_dict(),
            "calibration_s": calib_s, **evaluate(profile, w, members),
            "rounds": args.rounds, "steps_per_round": args.steps, "jax": jax.__version__}
  write_result(result, args.out or os.path.join(RESULTS, f"cost_model_{devices[0].platform}.json"))
  return 0


if __name__ == "__main__":
  start()
  raise SystemExit(main())
