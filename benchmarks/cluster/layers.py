"""Per-layer scaling of the cluster study's programs: a program compiled at two cut depths,
its schedule estimate extrapolated linearly to the model's depth (the layers are one scanned
loop: fixed part + layers x per-layer part), beside the program compiled at full depth.

It checks the per-layer scaling where the full program fits (static EP), and gives what a
program that does not fit its GPU's memory would estimate if it did (over its memory limit
XLA's scheduler stops overlapping collectives): Mixtral-8x7B's fsep program on 64 H100s.

  python -m benchmarks.cluster.layers --json benchmarks/cluster/results/cluster_layers_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from benchmarks.cluster import programs
from benchmarks.common import command, stamp, start, write_result

CASES = (("mixtral_8x7b", "8x1x8", "ep", True), ("mixtral_8x7b", "8x1x8", "fsep_planned", True))
DEPTHS = (8, 16)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.cluster.layers",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--cache", default=os.path.expanduser("~/.cache/moejax/cluster_programs.json"))
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  cache = programs.Cache(args.cache)
  rows = []
  for model, topo, kind, fsdp in CASES:
    full_spec = programs.Spec(model, topo, kind, 1.0, 0, fsdp)
    depth = programs.config(full_spec).model.num_layers
    cut = {d: cache.get(dataclasses.replace(full_spec, layers=d)) for d in DEPTHS}
    full = cache.get(full_spec)
    row = {"model": model, "topology": topo, "kind": kind, "factor": 1.0, "fsdp": fsdp,
           "depth": depth, "cut": {d: {k: r.get(k) for k in ("step_s", "exposed_comm_s",
                                                              "peak_bytes", "fits", "compile_s",
                                                              "lower_s")}
                                   for d, r in cut.items()},
           "full": {k: full.get(k) for k in ("step_s", "exposed_comm_s", "peak_bytes", "fits",
                                             "compile_s", "lower_s")}}
    if all(r["compiled"] for r in cut.values()):
      ext = programs.extrapolate(cut, depth)
      row["extrapolated"] = {"step_s": ext["step_s"], "exposed_comm_s": ext["exposed_comm_s"],
                             "grouped_matmul_s": ext["grouped_matmul"]["seconds"],
                             "per_layer_s": ext["per_layer_s"]}
      row["extrapolated_over_full"] = row["extrapolated"]["step_s"] / full["step_s"]
    rows.append(row)
    print(row)
  if args.json:
    out = stamp({"rows": rows, "depths": list(DEPTHS),
                 "command": command("cluster.layers", argv)})
    out["metadata"]["machine"]["device"] = programs.device_text()
    write_result(out, args.json, restamp=False)
  return 0


if __name__ == "__main__":
  start()
  sys.exit(main())
