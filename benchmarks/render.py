"""Renders the committed results: `docs/results.md` (one section per family of the studies'
`benchmarks/*/results/*.json`, a table each, then the files' metadata) and the README's
headline table between its `<!-- results:begin -->` and `<!-- results:end -->` markers.

  python -m benchmarks.render            # rewrite both
  python -m benchmarks.render --check    # exit 1 if either differs from a fresh render

Each family's table comes from one registered function in its study folder's `tables.py`;
SECTIONS orders them. Files named in SUPERSEDED are listed with the decision that holds their
figures, never rendered."""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import sys

from benchmarks.common import BENCHMARKS, METADATA_FIELDS, REPO
from benchmarks.families import FAMILIES, Family, Section, table

RESULTS_MD = os.path.join(REPO, "docs", "results.md")
README = os.path.join(REPO, "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
DECISIONS = "decisions"   # relative to docs/results.md

# The sections of docs/results.md (and rows of the README's table) in the order they show, by
# family prefix: placement and its planners, the trainer on CPU devices, then the GPU, then
# balance on a GPU cluster (and its CPU counterpart).
SECTIONS = (
    "replay_", "adaptive_capacity", "planner_time", "planner_ab", "planner_replay_ab",
    "replan_sweep", "migration_bytes", "smartmoe",
    "balance_pays", "fsep_vs_ep", "moe_layer", "cost_model", "strategy_switch", "routers",
    "published_mixtral", "chaos", "ragged_memory", "convert_memory", "replan_overhead",
    "kernels_", "gmm_tiles", "gpu_gmm_sweep", "layer_profile", "train_step", "gpu_compile",
    "on_gpu",
    "gpu_program", "gpu_levers", "loss_parity", "peer_maxtext", "cluster_h100", "cluster_cpu",
    "cluster_layers",
)

# Files whose figures a later run replaced: the decision that did so keeps them.
SUPERSEDED = {
    "layer_profile_h100_default.json": "0054-ragged-all-to-all-decomposed-on-gpu.md",
    "layer_profile_h100_decomposer.json": "0054-ragged-all-to-all-decomposed-on-gpu.md",
    "kernels_gpu_flags.json": "0054-ragged-all-to-all-decomposed-on-gpu.md",
    "strategy_switch_cpu.json": "0011-drifting-benchmark-runs-side-by-side.md",
    "strategy_switch_cpu_dff1024.json": "0011-drifting-benchmark-runs-side-by-side.md",
    "train_step_h100.json": "0090-one-gpu-step-tiled-loss-and-fused-attention.md",
    "on_gpu_h200_first.json": "0126-second-h200-run-held-out.md",
}


def machine_text(meta: dict) -> str:
  m = meta["machine"]
  if isinstance(m, str):
    return m
  return f"{m['device']}; {m['host']}; jax {m['jax']}"


def machine_short(meta: dict) -> str:
  m = meta["machine"]
  return (m if isinstance(m, str) else m["device"]).split(" (")[0]


def load_text(meta: dict) -> str:
  load = meta["load"]
  if isinstance(load, dict):
    return (f"{load['1min']} / {load['5min']} / {load['15min']} (1/5/15-min, "
            f"{load['cores']} cores)")
  return str(load)


def provenance(files: dict[str, dict]) -> list[str]:
  rows = [[f"`{name}`", f"`{d['metadata']['command']}`", d["metadata"]["commit"],
           d["metadata"]["date"][:19].replace("T", " "), machine_text(d["metadata"]),
           load_text(d["metadata"])] for name, d in files.items()]
  return ["", *table(["file", "command", "commit", "date (UTC)", "machine", "load"], rows)]


def studies() -> list[str]:
  """The study folders: the packages directly under benchmarks/."""
  return sorted(os.path.basename(os.path.dirname(p))
                for p in glob.glob(os.path.join(BENCHMARKS, "*", "__init__.py")))


def load_tables() -> None:
  """Imports every study folder's `tables.py`, which registers its families."""
  for study in studies():
    if os.path.exists(os.path.join(BENCHMARKS, study, "tables.py")):
      importlib.import_module(f"benchmarks.{study}.tables")


def result_paths() -> dict[str, str]:
  """{file name: its path from the repository root} of every committed result: each study's
  results/ folder. Names are unique across studies (the docs cite results by name)."""
  out: dict[str, str] = {}
  for path in sorted(glob.glob(os.path.join(BENCHMARKS, "*", "results", "*.json"))):
    name = os.path.basename(path)
    if name in out:
      raise SystemExit(f"{name} is in both {out[name]} and {os.path.relpath(path, REPO)}: "
                       "rename one (the docs cite results by file name)")
    out[name] = os.path.relpath(path, REPO)
  return dict(sorted(out.items()))


def load_results() -> dict[str, dict]:
  out = {}
  for name, path in result_paths().items():
    with open(os.path.join(REPO, path)) as f:
      out[name] = json.load(f)
  return out


def missing_metadata(results: dict[str, dict]) -> list[str]:
  """'file: field' for every metadata field a result lacks."""
  return [f"{name}: metadata.{k}" for name, d in results.items() for k in METADATA_FIELDS
          if not (d.get("metadata") or {}).get(k)]


def family_of(name: str) -> Family | None:
  load_tables()
  matches = [f for f in FAMILIES if name.startswith(f.prefix)]
  return max(matches, key=lambda f: len(f.prefix)) if matches else None


def sections(results: dict[str, dict]) -> list[tuple[Family, dict[str, dict], Section]]:
  groups: dict[str, dict[str, dict]] = {}
  unknown = [n for n in results if n not in SUPERSEDED and family_of(n) is None]
  if unknown:
    raise SystemExit(f"no renderer for {', '.join(unknown)}: register one in its study's "
                     "tables.py with @family(prefix, title)")
  for name, d in results.items():
    if name not in SUPERSEDED:
      groups.setdefault(family_of(name).prefix, {})[name] = d
  unordered = [f.prefix for f in FAMILIES if f.prefix not in SECTIONS]
  if unordered:
    raise SystemExit(f"families {', '.join(unordered)} have no place in benchmarks/render.py's "
                     "SECTIONS: add their prefixes where their sections should show")
  ordered = sorted(FAMILIES, key=lambda f: SECTIONS.index(f.prefix))
  return [(f, groups[f.prefix], f.render(groups[f.prefix])) for f in ordered
          if f.prefix in groups]


def render_results_md(results: dict[str, dict]) -> str:
  lines = ["# Results", "",
           "Rendered by `python -m benchmarks.render` from `benchmarks/*/results/*.json`: edit "
           "the JSON or the renderer, not this file. Each section ends with its files' "
           "command, commit, date, machine and load. On the 8 fake CPU devices the devices "
           "share the host's cores, so times measure work (rows computed, bytes moved), not "
           "parallel speed-up or network time. How each figure came about: "
           f"[the decision records]({DECISIONS}/README.md).", ""]
  for fam, files, sec in sections(results):
    lines += [f"## {fam.title}", "", *sec.lines, *provenance(files), ""]
  lines += ["## Superseded", "",
            "Committed files whose figures a later run replaced; the decision named keeps them.",
            "", *table(["file", "decision"], [[f"`{n}`", f"[{d[:4]}]({DECISIONS}/{d})"]
                                               for n, d in SUPERSEDED.items() if n in results])]
  return "\n".join(lines) + "\n"


def render_headline(results: dict[str, dict]) -> str:
  rows, paths = [], result_paths()
  for _, files, sec in sections(results):
    for what, value, name in sec.headline:
      rows.append([what, value, machine_short(files[name]["metadata"]),
                   f"[`{name}`]({paths[name]})"])
  return "\n".join(table(["result", "value", "machine", "from"], rows))


def readme_with_headline(readme: str, headline: str) -> str:
  if BEGIN not in readme or END not in readme:
    raise SystemExit(f"README.md lacks the {BEGIN} / {END} markers for the headline table")
  head, rest = readme.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return f"{head}{BEGIN}\n{headline}\n{END}{tail}"


def rendered(results: dict[str, dict] | None = None) -> dict[str, str]:
  """{path: the text it should hold} for docs/results.md and README.md."""
  results = load_results() if results is None else results
  with open(README) as f:
    readme = f.read()
  return {RESULTS_MD: render_results_md(results),
          README: readme_with_headline(readme, render_headline(results))}


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.render")
  ap.add_argument("--check", action="store_true", help="exit 1 if a rendered file is stale")
  args = ap.parse_args(argv)
  results = load_results()
  missing = missing_metadata(results)
  if missing:
    print("results without metadata (benchmarks.common.stamp): " + "; ".join(missing))
    return 1
  stale = []
  for path, text in rendered(results).items():
    if os.path.exists(path):
      with open(path) as f:
        if f.read() == text:
          continue
    stale.append(os.path.relpath(path, REPO))
    if not args.check:
      with open(path, "w") as f:
        f.write(text)
      print(f"wrote {os.path.relpath(path, REPO)}")
  if args.check and stale:
    print(f"stale: {', '.join(stale)}; run python -m benchmarks.render")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
