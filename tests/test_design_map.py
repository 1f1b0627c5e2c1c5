"""docs/design.md's package table is the map of where code lives, and it stays complete: every
package of `moejax` and `pallas_kernels` has a row that names each of its modules, the lab's
row names each of its folders and shared modules, and nothing the map names is gone.

The convention the map follows (one line to add per new module):
- a row's first cell is a backticked path: a package ends with `/` (`moejax/train/`), a
  module is a file (`moejax/frontend.py`; `moejax/{plan,replay}.py` names several);
- a package row names each of its modules as a backticked `name.py` and each subpackage as a
  backticked `name/` (a subpackage of `moejax` or `pallas_kernels` has its own row too;
  `__init__.py` and `__main__.py` need not be named); it names no other `name.py` or `name/`
  than its own, so a module is written with its package elsewhere (`moejax/train/step.py`);
- `benchmarks/` names its study folders and its shared modules; the studies inside a folder
  are listed by the folder's README and the guide's table, not here.
Backticked paths and dotted module names anywhere in the note must exist as well."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
TABLE_HEADING = "## Packages, in dependency order"
EXEMPT = {"__init__.py", "__main__.py"}
# Packages whose every subpackage gets a row of its own; benchmarks/ names its folders only.
MAPPED_ROOTS = ("moejax", "pallas_kernels")
LAB = "benchmarks"
TICKED = re.compile(r"`([^`]+)`")
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.py$")
SUBPACKAGE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*/$")


def _rows() -> dict[str, str]:
  """{first cell's path: second cell} of the package table, brace forms expanded."""
  text = DESIGN.read_text()
  assert TABLE_HEADING in text, f"docs/design.md lost its heading {TABLE_HEADING!r}"
  rows: dict[str, str] = {}
  for line in text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0].splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-", " "}:
      continue
    where = TICKED.fullmatch(cells[0])
    if where is None:
      continue  # the header row
    for path in _expand(where.group(1)):
      rows[path] = "|".join(cells[1:])
  return rows


def _expand(path: str) -> list[str]:
  brace = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", path)
  if brace is None:
    return [path]
  head, names, tail = brace.groups()
  return [f"{head}{name.strip()}{tail}" for name in names.split(",")]


def _packages() -> list[pathlib.Path]:
  """The packages that need a row: `moejax`'s own top-level modules have rows of their own."""
  found = [ROOT / LAB]
  for top in MAPPED_ROOTS:
    found += sorted(p.parent for p in (ROOT / top).rglob("__init__.py"))
  return [p for p in found if p != ROOT / "moejax"]


def _named(cell: str) -> tuple[set[str], set[str]]:
  """The `name.py` modules and `name/` subpackages a row's text names."""
  ticked = TICKED.findall(cell)
  return ({t for t in ticked if MODULE.match(t)}, {t[:-1] for t in ticked if SUBPACKAGE.match(t)})


def _rel(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def test_every_package_and_module_is_on_the_map():
  rows = _rows()
  missing = []
  for package in _packages():
    key = _rel(package) + "/"
    if key not in rows:
      missing.append(f"package {key}: add a row `{key}` to the table under {TABLE_HEADING!r}")
      continue
    modules, subpackages = _named(rows[key])
    for module in sorted(package.glob("*.py")):
      if module.name not in EXEMPT and module.name not in modules:
        missing.append(f"module {_rel(module)}: name it as `{module.name}` (with what it holds) "
                       f"in the row `{key}`")
    for sub in sorted(p.parent for p in package.glob("*/__init__.py")):
      if sub.name not in subpackages:
        missing.append(f"package {_rel(sub)}/: name it as `{sub.name}/` in the row `{key}`")
  for module in sorted((ROOT / "moejax").glob("*.py")):
    if _rel(module) not in rows:
      missing.append(f"module {_rel(module)}: add it to a top-level row such as "
                     f"`moejax/{{plan,replay,...}}.py`, or a row `{_rel(module)}` of its own")
  assert not missing, ("docs/design.md's map does not name:\n  " + "\n  ".join(missing))


def test_the_map_names_nothing_that_is_gone():
  stale = []
  for where, cell in _rows().items():
    path = ROOT / where
    if not path.exists():
      stale.append(f"row `{where}`: no such file or folder; remove or rename the row")
      continue
    if not path.is_dir():
      continue
    modules, subpackages = _named(cell)
    stale += [f"row `{where}` names `{name}`, which is not in {where} (a module of another "
              f"package is written with its path)" for name in sorted(modules)
              if not (path / name).is_file()]
    stale += [f"row `{where}` names `{name}/`, which is not a folder of {where}"
              for name in sorted(subpackages) if not (path / name).is_dir()]
  assert not stale, "docs/design.md's map is stale:\n  " + "\n  ".join(stale)


def test_paths_and_modules_the_design_note_names_exist():
  """A backticked repository path (`moejax/layout/migrate.py: fn`, `benchmarks/.../x.json`)
  and a dotted module (`python -m benchmarks.strategy.cost_model`) anywhere in the note."""
  roots = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
  gone = []
  prose = re.sub(r"^```.*?^```", "", DESIGN.read_text(), flags=re.M | re.S)
  for ticked in TICKED.findall(prose):
    for word in ticked.split():
      path = word.split(":")[0].rstrip(",;.)")
      if "/" in path and path.split("/")[0] in roots and not any(c in path for c in "{*"):
        if not (ROOT / path).exists():
          gone.append(path)
    for dotted in re.findall(r"\b(?:moejax|benchmarks|pallas_kernels)(?:\.[a-z0-9_]+)+",
                             ticked):
      if not _importable(dotted):
        gone.append(dotted)
  assert not gone, f"docs/design.md names what does not exist: {sorted(set(gone))}"


def _importable(dotted: str) -> bool:
  """A module or package of the tree, or an attribute written after a module (`a.b.fn`)."""
  parts = dotted.split(".")
  whole = ROOT.joinpath(*parts)
  return (whole.with_suffix(".py").is_file() or (whole / "__init__.py").is_file()
          or ROOT.joinpath(*parts[:-1]).with_suffix(".py").is_file())
