"""What an ep migration sends, read from the compiled programs the trainer runs: the default
run's training state (configs/default.gin with `--experts` experts, weights and both Adam
moments) on each mesh, and `moejax.layout.migrate.migration_call`, the call the re-planner's
switch makes. The moved-only program (a fixed budget of B rows per device pair, one all-to-all
per leaf) is compared with the whole permutation (the gather XLA partitions over the
expert-sharded slot axis). Bytes are per device, from `moejax.aot.read.collectives` on the
compiled programs' text; nothing runs but the state's initialisation. The moved-only program's
bytes do not depend on which slots move (up to the budget); the whole permutation's do not
either.

Run (from the repository root; 8 fake CPU devices, under a minute):

  python -m benchmarks.placement.migration_bytes
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.common import command, default_config, start, write_result
from moejax.aot.read import collective_summary, collectives
from moejax.config import num_moe_layers
from moejax.layout import migrate
from moejax.layout.tables import from_slot_expert
from moejax.strategy.placement_cost import of_config
from moejax.strategy.spec import parse as parse_spec
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import build_program
from moejax.train.state import init_state

DEFAULT_JSON = "benchmarks/placement/results/migration_bytes_cpu.json"
MESHES = ((2, 4, 1), (1, 8, 1))        # (data, expert, model)


def _compiled_text(fn, args) -> str:
  return fn.lower(*args).compile().as_text()


def measure(shape, experts: int) -> dict:
  """The default run's ep program on mesh `shape` with `experts` experts: the bytes per
  device of the migration programs for a change within the budget and past it."""
  data, n, model = shape
  cfg = default_config([f"mesh.data = {data}", f"mesh.expert = {n}", f"mesh.model = {model}",
                        f"moe.num_experts = {experts}", "moe.expert_mode = 'ep'"])
  tx, lr = optimizer(cfg.optim, 10), schedule(cfg.optim, 10)
  prog = build_program(cfg, parse_spec(f"ep/{data}x{n}x{model}"), tx, lr, compile_now=False)
  state = init_state(prog.model, tx, prog.shardings, prog.layout, cfg.data.global_batch_size,
                     cfg.data.seq_len, 0)
  layers = num_moe_layers(prog.cfg.model, prog.cfg.moe)
  budget = migrate.default_budget(experts, n)
  # Within the budget: each layer swaps device 0's first slot with device 1's.
  c = experts // n
  swapped = np.arange(experts)
  swapped[[0, c]] = swapped[[c, 0]]
  old = prog.state_layout(from_slot_expert(np.stack([np.arange(experts)] * layers), experts))
  new = prog.state_layout(from_slot_expert(np.stack([swapped] * layers), experts))
  moved = _compiled_text(*migrate.migration_call(state, old, new))
  whole = _compiled_text(*migrate.migration_call(state, old, new, whole=True))
  d, f = prog.cfg.model.d_model, prog.cfg.moe.d_ff
  expert_bytes = of_config(prog.cfg).expert_move_bytes(1)   # weights and both moments
  out = {"mesh": "x".join(map(str, shape)), "devices": n, "experts": experts, "layers": layers,
         "budget": budget, "d_model": d, "d_ff": f, "expert_bytes": expert_bytes}
  for name, hlo in (("moved_only", moved), ("whole", whole)):
    summary = collective_summary(collectives(hlo))
    out[name] = {"collectives": summary,
                 "bytes": sum(v["bytes"] for v in summary.values())}
  # What the budget carries at most: B experts from each other device, every layer.
  out["moved_experts_max"] = (n - 1) * budget * layers
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.placement.migration_bytes",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--experts", type=int, default=32)
  ap.add_argument("--json", default=DEFAULT_JSON)
  a = ap.parse_args(argv)
  rows = []
  for shape in MESHES:
    r = measure(shape, a.experts)
    rows.append(r)
    print(f"mesh {r['mesh']}: budget {r['budget']} rows/pair; moved-only "
          f"{r['moved_only']['bytes'] / 2**20:.2f} MiB "
          f"{sorted(r['moved_only']['collectives'])}, whole {r['whole']['bytes'] / 2**20:.2f} MiB "
          f"{sorted(r['whole']['collectives'])}", flush=True)
  write_result({"benchmark": "migration_bytes",
                "command": command("placement.migration_bytes", argv), "rows": rows}, a.json)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
