"""Balance that pays: each placement policy at the smallest buffer that keeps drops <= 1%.

On the 8 fake CPU devices as a (1, 8, 1) mesh, E = 16 experts, top-2, routing skewed by a
log-normal popularity (sigma 1 by default) that is stable across steps. Policies:

  static         per-(source, slot) capacity (the default `moe.capacity = 'slot'`), expert
                 e on device e // 2
  static_pooled  per-(source, device) capacity (`moe.capacity = 'device'`), static layout
  smartmoe       pooled capacity, the SmartMoE permutation planned on warm-up batches,
                 scored by the pooled drops of each warm-up batch
  fsep           pooled capacity, fsep weights with C = 4 slots per device and the fsep
                 planner's replicas from the warm-up batches

Each policy plans on warm-up batches, then its capacity factor is the smallest with <= 1% of
a different, timed batch's choices dropped (bisection on the counts, `moejax.layout.capacity`;
the dropped fraction reported is the compiled program's own count). Timed, all policies
interleaved step by step in rotating order:
  * the MoE layer, forward + backward, d_model 256, d_ff 1024, 2048 tokens per device
    (as `benchmarks.layer.fsep_vs_ep` builds it): the popularity enters through a constant input
    feature the router maps to log-popularity;
  * beside it (`--step`, on by default), a whole training step of the default model
    (configs/default.gin with E = 16, top-2, on the (1, 8, 1) mesh): the popularity enters
    as the layout's router bias, the learning rate is 1e-9 so the routing of the timed batch
    stays the one the factor was chosen for. The bias is scaled by `--step_bias_scale`
    (0.02): the initial router's logits hardly differ between tokens, so at scale 1 the bias
    decides alone and every token picks the two most popular experts; 0.02 gives about the
    layer's spread (its hottest expert taking ~30% of the choices).
On CPU the 8 devices share the host's cores: a ratio reflects work (rows computed and
exchanged, fsep's restores), not network time or a GPU's speed.

  python -m benchmarks.layer.balance_pays [--quick] \
      [--json benchmarks/layer/results/balance_pays_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import command, start, write_result
from benchmarks.layer import balance_setup as setup
from benchmarks.layer.fsep_vs_ep import routed_counts
from moejax.config import Config, MoEConfig, num_moe_layers
from moejax.frontend import DEFAULT_GIN, parse_config
from moejax.layout.host_layout import static as static_placement
from moejax.layout.tables import round_robin_placement
from moejax.model.mesh import BATCH_AXES, mesh_of_shape
from moejax.model.moe.harness import check_against_reference, layer_step, place_sharded
from moejax.strategy.spec import parse as parse_spec
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import build_program
from moejax.train.state import init_state

N = 8


def parse_args(argv):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.layer.balance_pays",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="seed 0 only, 4 rounds (<= 5 min)")
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--rounds", type=int, default=10, help="timed rounds (each runs every policy)")
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--top_k", type=int, default=2)
  ap.add_argument("--d_model", type=int, default=256)
  ap.add_argument("--d_ff", type=int, default=1024)
  ap.add_argument("--tokens_per_device", type=int, default=2048)
  ap.add_argument("--fsep_slots", type=int, default=4)
  ap.add_argument("--sigma", type=float, default=1.0)
  ap.add_argument("--warmup_batches", type=int, default=4)
  ap.add_argument("--step_bias_scale", type=float, default=0.02,
                  help="the step's router bias is this times the log-popularity; at 1 every "
                       "token picks the two most popular experts (the initial router's logits "
                       "hardly differ between tokens), ~0.02 gives the layer's spread")
  ap.add_argument("--step", action=argparse.BooleanOptionalAction, default=True,
                  help="also time a whole training step of the default model")
  ap.add_argument("--json", default="benchmarks/layer/results/balance_pays_cpu.json")
  args = ap.parse_args(argv)
  if args.quick:
    args.seeds, args.rounds = args.seeds[:1], min(args.rounds, 4)
  return args


def _layer_batch(rng, args):
  x = rng.standard_normal((N * args.tokens_per_device // 128, 128, args.d_model))
  x[..., 0] = 4.0                                      # the constant routing feature
  return x.astype(np.float32)


def layer_config(args) -> Config:
  """The config of a run whose MoE layer is the timed one (every other knob the default)."""
  cfg = Config()
  return dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, d_model=args.d_model),
      moe=dataclasses.replace(cfg.moe, num_experts=args.experts, top_k=args.top_k,
                              d_ff=args.d_ff))


def layer_setup(args, seed: int):
  """(params, warm-up counts [steps, W, E], timed batch, its counts [W, E]) of seed `seed`."""
  rng = np.random.default_rng(1000 + seed)
  d, f, e, k = args.d_model, args.d_ff, args.experts, args.top_k
  router = 0.05 * rng.standard_normal((d, e)).astype(np.float32)
  router[0] = setup.log_popularity(seed, e, args.sigma) / 4.0
  params = {"router": router,
            "w_gate": rng.standard_normal((e, d, f)).astype(np.float32) / d ** 0.5,
            "w_up": rng.standard_normal((e, d, f)).astype(np.float32) / d ** 0.5,
            "w_down": rng.standard_normal((e, f, d)).astype(np.float32) / f ** 0.5}
  warm = np.stack([routed_counts(_layer_batch(rng, args), router, k, N)
                   for _ in range(args.warmup_batches)])
  x = _layer_batch(rng, args)
  return params, warm, x, routed_counts(x, router, k, N)


def layer_runs(args, seed: int, mesh) -> dict:
  """Per policy: the compiled MoE-layer fwd+bwd at its factor, and what it dropped."""
  e, k = args.experts, args.top_k
  f = args.d_ff
  params, warm, x, counts_WxE = layer_setup(args, seed)
  x_dev = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
  placements = setup.plan(warm, N, args.fsep_slots, layer_config(args))
  runs = {}
  for policy in setup.POLICIES:
    p = placements[policy]
    cf = setup.needed_factor(policy, p, counts_WxE[None], args.tokens_per_device, k)
    cfg = MoEConfig(num_experts=e, top_k=k, capacity_factor=cf, d_ff=f,
                    expert_mode=setup.EXPERT_MODE[policy], capacity=setup.CAPACITY[policy])
    layout = setup.device_layout(policy, [p], e)
    # One step's outputs and gradients equal the single-device reference's before timing.
    row = jax.tree.map(lambda a: a[0], layout)
    check_against_reference(cfg, mesh, row, params, x[:N])
    fn, fn_args = layer_step(cfg, mesh), place_sharded(params, x_dev, row, mesh, cfg.expert_mode)
    (_, (_, stats)), _ = jax.block_until_ready(fn(*fn_args))   # compile + warm-up
    dropped = np.sum(stats.dropped_W)
    predicted = setup.predicted_dropped(policy, p, counts_WxE, args.tokens_per_device, k, cf)
    if int(dropped) != predicted:
      raise RuntimeError(f"{policy}: the layer dropped {int(dropped)} choices, the capacity "
                         f"arithmetic predicted {predicted}")
    runs[policy] = {"run": lambda fn=fn, a=fn_args: fn(*a), "capacity_factor": cf,
                    "dropped_fraction": int(dropped) / counts_WxE.sum(),
                    "tokens": N * args.tokens_per_device}
  return runs


def _model_config(args, policy: str | None, cf: float):
  bindings = ["mesh.data = 1", f"mesh.expert = {N}", f"moe.num_experts = {args.experts}",
              f"moe.top_k = {args.top_k}", "planner.policy = 'static'",
              "optim.learning_rate = 1e-9", "optim.warmup_steps = 1"]
  cfg = parse_config([DEFAULT_GIN], bindings)
  mode = setup.EXPERT_MODE.get(policy, "ep")
  moe = dataclasses.replace(cfg.moe, capacity=setup.CAPACITY.get(policy, "slot"),
                            expert_mode=mode, capacity_factor=cf,
                            slots_per_device=args.fsep_slots if mode == "fsep" else 0)
  spec = f"{mode}/1x{N}x1" + (f"/c{args.fsep_slots}" if mode == "fsep" else "") + f"/cf{cf!r}"
  return dataclasses.replace(cfg, moe=moe), parse_spec(spec)


def _program(cfg, spec, layout_host=None):
  tx, lr = optimizer(cfg.optim, 10), schedule(cfg.optim, 10)
  prog = build_program(cfg, spec, tx, lr)
  if layout_host is not None:
    prog.layout = jax.device_put(layout_host, prog.layout_sharding)
  state = init_state(prog.model, tx, prog.shardings, prog.layout, cfg.data.global_batch_size,
                     cfg.data.seq_len, 0)
  return prog, state


def _routing(prog, state, batches):
  """(warm-up counts [steps, L, W, E], the timed batch's [L, W, E]) of `prog`'s own router:
  the last batch is the timed one."""
  counts = []
  for batch in batches:
    state, m = prog.train_step(state, batch, prog.layout)
    counts.append(np.asarray(m["counts_LxWxE"]))
  return np.stack(counts[:-1]), counts[-1]


def step_runs(args, seed: int) -> dict:
  """Per policy: a whole training step of the default model at its factor. ep and fsep
  programs initialise their parameters apart (their experts are laid out differently), so
  they route the same batch differently: each expert mode plans and sizes its buffers on its
  own program's routing of the warm-up and timed batches (at a factor where nothing drops),
  as the trainer's re-planner sees its own program's counts."""
  cfg, spec = _model_config(args, None, args.experts / args.top_k)   # nothing can drop
  layers = num_moe_layers(cfg.model, cfg.moe)
  bias_LxE = np.tile(args.step_bias_scale * setup.log_popularity(seed, args.experts, args.sigma),
                     (layers, 1))
  static = setup.device_layout("static", [static_placement(args.experts, N)] * layers,
                               args.experts, bias_LxE)
  prog, state = _program(cfg, spec, static)
  rng = np.random.default_rng(2000 + seed)
  shape = (cfg.data.global_batch_size, cfg.data.seq_len + 1)
  batches = [jax.device_put(rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32),
                            prog.batch_sharding) for _ in range(args.warmup_batches + 1)]
  routing = {"ep": _routing(prog, state, batches)}
  start = round_robin_placement(args.experts, N, args.fsep_slots)
  fcfg, fspec = _model_config(args, "fsep", args.experts / args.top_k)
  routing["fsep"] = _routing(*_program(fcfg, fspec, setup.device_layout(
      "fsep", [start] * layers, args.experts, bias_LxE)), batches)
  tokens = cfg.data.global_batch_size * cfg.data.seq_len // N
  plans = {mode: [setup.plan(warm[:, layer], N, args.fsep_slots, cfg) for layer in range(layers)]
           for mode, (warm, _) in routing.items()}
  runs = {}
  for policy in setup.POLICIES:
    mode = setup.EXPERT_MODE[policy]
    placements = [per_layer[policy] for per_layer in plans[mode]]
    timed_LxWxE = routing[mode][1]
    cf = max(setup.needed_factor(policy, p, c[None], tokens, args.top_k)
             for p, c in zip(placements, timed_LxWxE))
    pcfg, pspec = _model_config(args, policy, cf)
    prog, state = _program(pcfg, pspec, setup.device_layout(policy, placements, args.experts,
                                                            bias_LxE))
    box = {"state": state, "dropped": [], "choices": 0}

    def run(prog=prog, box=box, batch=batches[-1]):
      box["state"], m = prog.train_step(box["state"], batch, prog.layout)
      box["dropped"].append(m["dropped_LxW"])
      return m["loss"]

    jax.block_until_ready(run())
    runs[policy] = {"run": run, "capacity_factor": cf, "box": box,
                    "choices": int(timed_LxWxE.sum()), "tokens": N * tokens}
  return runs


def time_interleaved(runs: dict, rounds: int) -> dict:
  """Seconds per call of each run, one call of every run per round, the order rotating."""
  names, times = list(runs), {name: [] for name in runs}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(runs[name]["run"]())
      times[name].append(time.perf_counter() - t0)
  return times


def _geomean(xs):
  return float(np.exp(np.mean(np.log(xs))))


def main(argv=None) -> int:
  args = parse_args(argv)
  mesh = mesh_of_shape((1, N, 1))
  rows, t_start = [], time.perf_counter()
  for seed in args.seeds:
    layer = layer_runs(args, seed, mesh)
    layer_t = time_interleaved(layer, args.rounds)
    steps = step_runs(args, seed) if args.step else {}
    step_t = time_interleaved(steps, args.rounds) if steps else {}
    for policy in setup.POLICIES:
      lr_ = layer[policy]
      row = {"policy": policy, "seed": seed, "capacity_factor": lr_["capacity_factor"],
             "dropped_fraction": lr_["dropped_fraction"],
             "tokens_per_s": lr_["tokens"] / statistics.median(layer_t[policy]),
             "layer_times_s": layer_t[policy]}
      if steps:
        s = steps[policy]
        dropped = np.asarray(jax.device_get(s["box"]["dropped"])).sum((1, 2))
        row.update(step_capacity_factor=s["capacity_factor"],
                   step_dropped_fraction=float(dropped.max() / s["choices"]),
                   step_tokens_per_s=s["tokens"] / statistics.median(step_t[policy]),
                   step_times_s=step_t[policy])
      rows.append(row)
  ratios, per_round = _ratios(rows, args.seeds)
  _print(rows, ratios, per_round)
  if args.json:
    write_result({"rows": rows, "ratios": ratios, "per_round_ratios": per_round,
                  "args": vars(args), "wall_s": time.perf_counter() - t_start,
                  "devices": [str(d) for d in jax.devices()[:N]], "jax": jax.__version__,
                  "command": command("layer.balance_pays", argv),
                  "time": datetime.datetime.now(datetime.UTC).isoformat()}, args.json)
  return 0


def _ratios(rows, seeds):
  """tokens/s over static per policy: per seed, their geometric mean, and per round."""
  by = {(r["policy"], r["seed"]): r for r in rows}
  ratios, per_round = {}, {}
  for key in ("tokens_per_s", "step_tokens_per_s"):
    if key not in rows[0]:
      continue
    times = "layer_times_s" if key == "tokens_per_s" else "step_times_s"
    for policy in setup.POLICIES[1:]:
      per_seed = [by[policy, s][key] / by["static", s][key] for s in seeds]
      ratios[f"{policy}/{key}"] = {"per_seed": per_seed, "geomean": _geomean(per_seed)}
      per_round[f"{policy}/{key}"] = [
          [a / b for a, b in zip(by["static", s][times], by[policy, s][times])] for s in seeds]
  return ratios, per_round


def _print(rows, ratios, per_round):
  print(f"{'policy':<14}{'seed':>5}{'cf':>8}{'dropped':>9}{'layer tok/s':>13}{'step cf':>9}"
        f"{'step drop':>10}{'step tok/s':>12}")
  for r in rows:
    print(f"{r['policy']:<14}{r['seed']:>5}{r['capacity_factor']:>8.3f}"
          f"{r['dropped_fraction']:>9.2%}{r['tokens_per_s']:>13.0f}"
          f"{r.get('step_capacity_factor', float('nan')):>9.3f}"
          f"{r.get('step_dropped_fraction', float('nan')):>10.2%}"
          f"{r.get('step_tokens_per_s', float('nan')):>12.0f}")
  for name, v in ratios.items():
    rounds = "; ".join(" ".join(f"{x:.2f}" for x in seed) for seed in per_round[name])
    print(f"{name} over static: geomean {v['geomean']:.2f}x, per seed "
          f"{' '.join(f'{x:.2f}' for x in v['per_seed'])}; per round {rounds}")


if __name__ == "__main__":
  start()
  sys.exit(main())
