"""What an ep migration sends, read from the compiled programs: the moved-only program (a fixed
budget of B rows per device pair, one all-to-all per leaf) against the whole permutation (the
gather XLA partitions over the expert-sharded slot axis), per mesh, for the default run's
expert size (d_model x d_ff) with weights and both Adam moments. Bytes are per device, from
`moejax.aot.read.collectives` on `jax.jit(...).lower(...).compile().as_text()`; compile only,
nothing runs. The moved-only program's bytes do not depend on which slots move (up to the
budget); the whole permutation's do not either.

Run (from the repository root; 8 fake CPU devices, under a minute):

  python -m benchmarks.migration_bytes
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import (
  NamedSharding,  # noqa: E402
  PartitionSpec as P,  # noqa: E402
)

from benchmarks.common import command, write_result  # noqa: E402
from moejax.aot.read import collective_summary, collectives  # noqa: E402
from moejax.config import Config  # noqa: E402
from moejax.layout import migrate  # noqa: E402
from moejax.layout.tables import from_slot_expert  # noqa: E402

DEFAULT_JSON = "benchmarks/results/migration_bytes_cpu.json"
MESHES = ((2, 4, 1), (1, 8, 1))        # (data, expert, model)


def measure(shape, experts: int, layers: int, d: int, f: int) -> dict:
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), ("data", "expert", "model"))
  n = shape[1]

  def leaf(spec):
    return jax.ShapeDtypeStruct((layers, experts, d, f), np.float32,
                                sharding=NamedSharding(mesh, spec))
  moe = lambda: {"moe": {"w_gate": leaf(P(None, "expert", None, "model")),   # noqa: E731
                         "w_up": leaf(P(None, "expert", None, "model")),
                         "w_down": leaf(P(None, "expert", "model", None))}}
  state = {"params": moe(), "mu": moe(), "nu": moe()}
  budget = migrate.default_budget(experts, n)
  table = NamedSharding(mesh, P("expert", None))
  tables = jax.ShapeDtypeStruct((n, layers, n * budget), np.int32, sharding=table)
  pick = jax.ShapeDtypeStruct((n, layers, experts // n), np.int32, sharding=table)
  moved = migrate._moved_program(state, mesh, "expert", None, budget).lower(
      state, tables, pick).compile().as_text()
  src = from_slot_expert(np.stack([np.arange(experts)] * layers), experts).slot_expert_LxS
  whole = jax.jit(migrate.gather_slots).lower(state, src).compile().as_text()
  expert_bytes = 3 * 3 * d * f * 4            # weights and both moments of one expert
  out = {"mesh": "x".join(map(str, shape)), "devices": n, "experts": experts, "layers": layers,
         "budget": budget, "expert_bytes": expert_bytes}
  for name, hlo in (("moved_only", moved), ("whole", whole)):
    summary = collective_summary(collectives(hlo))
    out[name] = {"collectives": summary,
                 "bytes": sum(v["bytes"] for v in summary.values())}
  # What the budget carries at most: B experts from each other device, every layer.
  out["moved_experts_max"] = (n - 1) * budget * layers
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.migration_bytes",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--experts", type=int, default=32)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--json", default=DEFAULT_JSON)
  a = ap.parse_args(argv)
  cfg = Config()
  rows = []
  for shape in MESHES:
    r = measure(shape, a.experts, a.layers, cfg.model.d_model, cfg.moe.d_ff)
    rows.append(r)
    print(f"mesh {r['mesh']}: budget {r['budget']} rows/pair; moved-only "
          f"{r['moved_only']['bytes'] / 2**20:.2f} MiB "
          f"{sorted(r['moved_only']['collectives'])}, whole {r['whole']['bytes'] / 2**20:.2f} MiB "
          f"{sorted(r['whole']['collectives'])}", flush=True)
  write_result({"benchmark": "migration_bytes", "command": command("migration_bytes", argv),
                "d_model": cfg.model.d_model, "d_ff": cfg.moe.d_ff, "rows": rows}, a.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
