"""The committed results carry their provenance, and what the docs show is what they hold:
docs/results.md and the README's headline table equal a fresh render of the JSON."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import common, render


@pytest.fixture(scope="module")
def results():
  return render.load_results()


def test_every_result_carries_its_metadata(results):
  assert results, f"no JSON under {common.BENCHMARKS}/*/results"
  missing = render.missing_metadata(results)
  assert not missing, (f"results lacking metadata: {missing}; stamp them with python -m "
                       "benchmarks.common stamp FILE --command '...'")
  for name, d in results.items():
    machine = d["metadata"]["machine"]
    assert isinstance(machine, str) or {"device", "host", "jax"} <= set(machine), name


def test_every_result_has_a_renderer_or_a_superseding_decision(results):
  unclaimed = [n for n in results if n not in render.SUPERSEDED and render.family_of(n) is None]
  assert not unclaimed, f"no @family renderer in a study's tables.py for {unclaimed}"
  decisions = os.path.join(common.REPO, "docs", "decisions")
  for name, record in render.SUPERSEDED.items():
    assert os.path.exists(os.path.join(decisions, record)), f"{name}: {record} does not exist"


def test_rendered_docs_are_current(results):
  for path, text in render.rendered(results).items():
    with open(path) as f:
      assert f.read() == text, (f"{os.path.relpath(path, common.REPO)} is stale: run "
                                "python -m benchmarks.render and commit what it writes")


def test_a_result_rendered_from_changed_json_changes_the_docs(results):
  """The comparison above is not vacuous: a changed figure shows in both rendered texts."""
  changed = json.loads(json.dumps(results))
  changed["balance_pays_cpu.json"]["ratios"]["fsep/tokens_per_s"]["geomean"] = 9.87
  before, after = render.rendered(results), render.rendered(changed)
  for path in before:
    assert before[path] != after[path] and "9.87x" in after[path], path


def test_write_result_stamps_the_metadata(tmp_path):
  path = tmp_path / "r.json"
  common.write_result({"rows": [1], "command": "python -m benchmarks.x --y 1"}, str(path))
  written = json.loads(path.read_text())
  assert "command" not in written and written["rows"] == [1]
  meta = written["metadata"]
  assert meta["command"] == "python -m benchmarks.x --y 1"
  assert all(meta[k] for k in common.METADATA_FIELDS)
  assert set(meta["load"]) == {"1min", "5min", "15min", "cores"}
  with pytest.raises(ValueError, match="command"):
    common.write_result({"rows": []}, str(tmp_path / "s.json"))
