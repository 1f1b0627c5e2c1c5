"""The lab's studies as a newcomer meets them: every runnable one under benchmarks/ (found in
the tree, not listed here) answers `--help` from its entry, importing any of them starts
nothing (no JAX backend, no subprocess such as git, no XLA_FLAGS), the guide's table and its
folder's README name each, no study imports another's private names, and every result file
sits in the folder whose tables render it."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks import render

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
GUIDE = ROOT / "docs" / "guide" / "tools-and-benchmarks.md"


def _module(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_main_block(node: ast.stmt) -> bool:
  return isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"


def runnables() -> list[str]:
  """Every module under benchmarks/ with an `if __name__ == "__main__":` block."""
  return [_module(p) for p in sorted(BENCHMARKS.rglob("*.py"))
          if any(_is_main_block(n) for n in ast.parse(p.read_text()).body)]


def studies() -> list[str]:
  """The runnables inside a study folder (the others are the lab's own commands)."""
  return [m for m in runnables() if m.count(".") == 2]


# Imports every runnable with subprocesses refused (git at import would fail), reports whether
# that started a JAX backend or set XLA_FLAGS, then runs each as `python -m NAME --help` does
# (as __main__, through its entry) and reports the exit code and what it printed.
PROBE = r"""
import contextlib, importlib, io, json, os, runpy, subprocess, sys

def refuse(*args, **kwargs):
  raise AssertionError(f"a subprocess at import: {args[0] if args else kwargs}")

names, popen = sys.argv[1:], subprocess.Popen
subprocess.Popen = refuse
failed = {}
for name in names:
  try:
    importlib.import_module(name)
  except Exception as e:
    failed[name] = f"{type(e).__name__}: {e}"
subprocess.Popen = popen
from jax._src import xla_bridge
report = {"import_failed": failed, "backends_started": xla_bridge.backends_are_initialized(),
          "xla_flags": os.environ.get("XLA_FLAGS"), "help": {}}
for name in names:
  sys.modules.pop(name, None)
  out, sys.argv = io.StringIO(), [name, "--help"]
  try:
    with contextlib.redirect_stdout(out):
      runpy.run_module(name, run_name="__main__", alter_sys=True)
    code = "returned without exiting"
  except SystemExit as e:
    code = e.code
  except Exception as e:
    code = f"{type(e).__name__}: {e}"
  report["help"][name] = {"code": code, "out": out.getvalue()}
print("PROBE" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def probe():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", PROBE, *runnables()], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.rsplit("PROBE", 1)[1])


def test_importing_a_study_starts_nothing(probe):
  assert not probe["import_failed"], probe["import_failed"]
  assert not probe["backends_started"], ("importing a study started a JAX backend: a device "
                                         "query or an array at module level comes before its "
                                         "entry fakes the CPU devices (benchmarks.common.start)")
  assert probe["xla_flags"] is None, f"importing a study set XLA_FLAGS={probe['xla_flags']}"


def test_every_runnable_answers_help_from_its_entry(probe):
  assert len(probe["help"]) == len(runnables()) >= 20, sorted(probe["help"])
  for name, r in probe["help"].items():
    assert r["code"] in (0, None), f"python -m {name} --help: exit {r['code']}"
    assert r["out"].startswith(f"usage: python -m {name} "), (
        f"python -m {name} --help prints {r['out'][:80]!r}; give its ArgumentParser "
        f"prog='python -m {name}'")


def test_every_study_fakes_its_devices_first_in_its_entry():
  """`common.start()` is the first statement of each study's __main__ block: the fake CPU
  devices are set before main() can start a backend."""
  late = []
  for name in studies():
    tree = ast.parse((ROOT / (name.replace(".", "/") + ".py")).read_text())
    block = next(n for n in tree.body if _is_main_block(n))
    if ast.unparse(block.body[0]) != "start()":
      late.append(name)
  assert not late, f"__main__ blocks that do not begin with start(): {late}"


def _guide_table_commands() -> set[str]:
  rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("|")]
  return set(re.findall(r"python -m (benchmarks(?:\.\w+)+)", "\n".join(rows)))


def test_the_guide_lists_every_runnable_and_no_other():
  listed = _guide_table_commands()
  missing = sorted(set(runnables()) - listed)
  assert not missing, f"{GUIDE.relative_to(ROOT)}'s tables lack a row for {missing}"
  gone = sorted(listed - set(runnables()))
  assert not gone, f"{GUIDE.relative_to(ROOT)} lists modules that are not runnable: {gone}"


def _slug(title: str) -> str:
  """A markdown heading's anchor, as GitHub makes it."""
  return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_every_study_folder_has_a_readme_naming_its_studies_and_tables():
  folders = sorted(p.parent.name for p in BENCHMARKS.glob("*/__init__.py"))
  index = (BENCHMARKS / "README.md").read_text()
  assert not [f for f in folders if f"({f}/README.md)" not in index], (
      f"benchmarks/README.md does not link every study folder: {folders}")
  sections = {_slug(line[3:]) for line in (ROOT / "docs" / "results.md").read_text().splitlines()
              if line.startswith("## ")}
  for folder in folders:
    readme = BENCHMARKS / folder / "README.md"
    assert readme.exists(), f"benchmarks/{folder}/ has no README.md"
    text = readme.read_text()
    unnamed = [m for m in studies() if m.split(".")[1] == folder and f"python -m {m}" not in text]
    assert not unnamed, f"{readme.relative_to(ROOT)} does not say how to run {unnamed}"
    anchors = re.findall(r"results\.md#([\w-]+)\)", text)
    assert anchors, f"{readme.relative_to(ROOT)} names no section of docs/results.md"
    stale = [a for a in anchors if a not in sections]
    assert not stale, f"{readme.relative_to(ROOT)} links sections docs/results.md lacks: {stale}"


def test_no_study_imports_a_private_name():
  taken = [f"{p.relative_to(ROOT)}: {node.module}.{a.name}"
           for p in sorted(BENCHMARKS.rglob("*.py"))
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks")
           for a in node.names if a.name.startswith("_")]
  assert not taken, f"private names imported across modules: {taken}"


def test_every_result_sits_beside_the_tables_that_render_it():
  astray = []
  for name, path in render.result_paths().items():
    folder = pathlib.Path(path).parts[1]
    fam = render.family_of(name)
    if fam is not None and fam.render.__module__ != f"benchmarks.{folder}.tables":
      astray.append(f"{path} (rendered by {fam.render.__module__})")
  assert not astray, f"results outside the folder whose tables render them: {astray}"
