"""The package tree is the design: dependencies run one way and no file outgrows its concern."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# config -> layout -> model -> placement -> strategy -> runtime -> train -> command-line shells.
# Device code (model) never imports a host policy (placement, strategy).
LAYERS = ("config", "layout", "model", "placement", "strategy", "runtime", "train")
MAX_LINES = 400


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in (ROOT / "moejax").rglob("*.py")}


def _imports(path: pathlib.Path) -> set[str]:
  """Every moejax module a file imports, at any depth (function-level imports count too)."""
  known = _modules()
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("moejax"))
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moejax"):
      for a in node.names:   # `from moejax.pkg import module` imports the module
        sub = f"{node.module}.{a.name}"
        found.add(sub if sub in known else node.module)
  return found


def _layer(module: str) -> int:
  parts = module.split(".")
  top = parts[1] if len(parts) > 1 else ""
  return LAYERS.index(top) if top in LAYERS else len(LAYERS)   # shells come last


def test_no_module_imports_a_later_layer():
  backward = []
  for name, path in _modules().items():
    for dep in _imports(path):
      if _layer(dep) > _layer(name):
        backward.append(f"{name} -> {dep}")
  assert not backward, "imports against the layer order " + " < ".join(LAYERS) + ": " + \
      ", ".join(sorted(backward))


def test_no_import_cycles():
  graph = {name: {d for d in _imports(p) if d != name} for name, p in _modules().items()}
  state: dict[str, int] = {}   # 1: on the stack, 2: done

  def visit(node, stack):
    state[node] = 1
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == 1:
        raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
      if dep in graph and not state.get(dep):
        visit(dep, stack + [dep])
    state[node] = 2

  for name in sorted(graph):
    if not state.get(name):
      visit(name, [name])


def test_kernels_and_library_stay_independent_of_their_users():
  """pallas_kernels holds kernels only; only the front end (and train.py) imports gin."""
  for path in (ROOT / "pallas_kernels").rglob("*.py"):
    assert not _imports(path), f"{path.name} imports moejax"
  for path in (ROOT / "moejax").rglob("*.py"):
    tree = ast.parse(path.read_text())
    gin = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and
           any((getattr(n, "module", None) or a.name).split(".")[0] == "gin" for a in n.names)]
    assert not gin or path.name == "frontend.py", f"{path} imports gin"


def test_files_stay_small_and_the_package_shallow():
  files = [ROOT / "train.py"] + [p for d in ("moejax", "pallas_kernels", "benchmarks")
                                 for p in (ROOT / d).rglob("*.py")]
  long = [f"{p.relative_to(ROOT)}: {n}" for p in files
          if (n := len(p.read_text().splitlines())) > MAX_LINES]
  assert not long, f"files over {MAX_LINES} lines: {long}"
  top = sorted(p.name for p in (ROOT / "moejax").glob("*.py") if p.name != "__init__.py")
  assert len(top) <= 8, f"moejax/ has {len(top)} top-level modules: {top}"


def test_tests_share_code_through_helper_modules():
  """A test module imports helpers (tests/helpers.py, moe_helpers.py, ...), never another test
  module: importing one runs its module-level set-up and couples the two files."""
  offenders = [f"{p.name} -> {dep}" for p in (ROOT / "tests").glob("*.py")
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ImportFrom) and node.module
               for dep in [node.module] + [f"{node.module}.{a.name}" for a in node.names]
               if dep.startswith("tests.test_")]
  assert not offenders, f"test modules importing test modules: {offenders}"
