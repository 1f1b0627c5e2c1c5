"""The MaxText peer study (benchmarks.peer.peer_maxtext): our rows run without MaxText, the wheels
it needs on a GPU machine are pinned and fit what a run can carry, and where MaxText is
installed each of its CPU paths computes what our layer computes at the same drops."""

from __future__ import annotations

import json

import pytest

from benchmarks.peer import maxtext_layer as peer, peer_maxtext as study

CARRY_BYTES = 64 * 2**20   # what a GPU run can carry beside the repository (about 7 MB)


def _run(tmp_path, *argv):
  path = tmp_path / "peer.json"
  study.main(["--tiny", "--devices", "8", "--json", str(path), *argv])
  return json.loads(path.read_text())


def _rows(result, devices="8"):
  return {r["path"]: r for r in result["meshes"][devices]["rows"]}


def test_the_wheels_are_pinned_fetched_without_deps_and_fit_a_gpu_run():
  cmd = peer.download_command("WHEELS")
  assert "--no-deps" in cmd and "--python-version 3.12" in cmd and "-d WHEELS" in cmd
  names = [w.split("==")[0] for w in peer.PEER_WHEELS]
  assert len(set(names)) == len(names) and names[0] == "maxtext"
  assert all(w.count("==") == 1 and w in cmd for w in peer.PEER_WHEELS)
  assert peer.PEER_WHEELS_BYTES + 10 * 2**20 < CARRY_BYTES
  assert peer.install_command("WHEELS") == "pip install --no-deps --no-index WHEELS/*.whl"


def test_our_rows_run_without_maxtext_and_the_dense_twin_drops(tmp_path):
  result = _run(tmp_path, "--no_peer")
  assert result["peer"] == {"maxtext": None, "why_absent": "not asked for (--no_peer)"}
  rows = _rows(result)
  assert set(rows) == {"moejax/config", "moejax/dense"}
  for row in rows.values():
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and "error" not in row
  # 8 experts on 8 devices at capacity factor 1.25 drop some choices; the ragged buffer of
  # twice the balanced share drops none of these tokens.
  assert rows["moejax/config"]["dropped"] == 0
  assert 0 < rows["moejax/dense"]["dropped_fraction"] < 0.2
  assert [s["maxtext"] for s in result["meshes"]["8"]["summary"]] == [None, None]


def test_maxtext_computes_what_we_compute_at_equal_drops(tmp_path):
  mt, why = peer.import_peer()
  if mt is None:
    pytest.skip(why)
  result = _run(tmp_path, "--dtype", "float32",
                "--paths", "maxtext/dense_capacity,maxtext/ragged_dot")
  rows = _rows(result)
  capacity, ragged_dot = rows["maxtext/dense_capacity"], rows["maxtext/ragged_dot"]
  assert capacity["dropped"] == rows["moejax/dense"]["dropped"] > 0
  assert ragged_dot["dropped"] == rows["moejax/config"]["dropped"] == 0
  for row in (capacity, ragged_dot):
    assert row["agreement"]["ok"], row["agreement"]
  summary = {s["drops"]: s for s in result["meshes"]["8"]["summary"]}
  assert summary["capacity"]["maxtext"] == "maxtext/dense_capacity"
  assert summary["dropless"]["maxtext"] == "maxtext/ragged_dot"


def test_the_summary_pairs_equal_drops_and_says_when_the_faster_peer_disagrees():
  """The committed H200 run: MaxText's tokamax path is the fastest dropless one, and its
  weight gradients are 5-6% off ours (beyond the 4% tolerance), which the summary carries."""
  rows = [
      {"drops": "dropless", "side": "moejax", "path": "moejax/config", "fwd_ms": 1.0,
       "fwd_bwd_ms": 3.0, "dropped": 0},
      {"drops": "dropless", "side": "maxtext", "path": "maxtext/fast", "fwd_ms": 1.5,
       "fwd_bwd_ms": 2.0, "dropped": 0, "agreement": {"ok": False}},
      {"drops": "dropless", "side": "maxtext", "path": "maxtext/slow", "fwd_ms": 2.0,
       "fwd_bwd_ms": 6.0, "dropped": 0, "agreement": {"ok": True}},
      {"drops": "capacity", "side": "moejax", "path": "moejax/dense", "fwd_ms": 1.0,
       "fwd_bwd_ms": 2.0, "dropped": 9},
      {"drops": "capacity", "side": "maxtext", "path": "maxtext/capacity", "fwd_ms": 2.0,
       "fwd_bwd_ms": 4.0, "dropped": 9, "agreement": {"ok": True}},
      {"drops": "capacity", "side": "maxtext", "path": "maxtext/other_drops", "fwd_ms": 0.1,
       "fwd_bwd_ms": 0.2, "dropped": 3}]
  dropless, capacity = study.summarise(rows)
  assert (dropless["maxtext"], dropless["ours_ahead"], dropless["maxtext_agrees"]) == (
      "maxtext/fast", False, False)
  assert dropless["fwd_bwd_ratio"] == pytest.approx(2 / 3)
  assert (capacity["maxtext"], capacity["ours_ahead"], capacity["maxtext_agrees"]) == (
      "maxtext/capacity", True, True)
