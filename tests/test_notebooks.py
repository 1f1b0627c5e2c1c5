"""The notebooks in notebooks/ run top to bottom in a kernel of this Python (nbclient); any
cell's error fails the test. They are stored without outputs, so their diffs stay clean."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tests.run_config import REPO_ROOT
from tests.run_helpers import subprocess_env

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO_ROOT, "notebooks", "*.ipynb")))
CELL_TIMEOUT_S = 300


def test_there_are_notebooks_and_they_hold_no_outputs():
  # Plain JSON (nbformat 4): the README's test command does not install Jupyter.
  assert len(NOTEBOOKS) >= 2
  for path in NOTEBOOKS:
    with open(path) as f:
      nb = json.load(f)
    assert nb["nbformat"] == 4, path
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code), path
    assert "xla_force_host_platform_device_count=8" in "".join(code[0]["source"]), path


def test_every_markdown_cell_opens_with_a_heading_that_renders():
  """A markdown cell is shown as Markdown: its first line is a `#` heading, not a leftover
  cell marker such as `md` before it (which shows the `#` as text)."""
  for path in NOTEBOOKS:
    with open(path) as f:
      cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "markdown"]
    assert cells, path
    for cell in cells:
      first = "".join(cell["source"]).splitlines()[0]
      assert re.fullmatch(r"#{1,6} \S.*", first), f"{os.path.basename(path)}: {first!r}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom(path, monkeypatch):
  nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[notebooks]'")
  NotebookClient = pytest.importorskip(
      "nbclient", reason="pip install -e '.[notebooks]'").NotebookClient

  # The kernel inherits this environment: 8 CPU devices and the session's compilation cache.
  for key, value in subprocess_env().items():
    monkeypatch.setenv(key, value)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                          resources={"metadata": {"path": os.path.dirname(path)}})
  client.execute()   # raises CellExecutionError on the first failing cell
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
