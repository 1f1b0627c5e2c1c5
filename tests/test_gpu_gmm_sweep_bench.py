"""benchmarks.kernels.gpu_gmm_sweep's code path on CPU (`--tiny`: tiny shapes, the Pallas kernels
interpreted): every pass of every candidate gives a row, checked against jax.lax.ragged_dot,
and the summary names the fastest correct one beside the dense dot. The numbers measure
nothing here; the GPU run is the lead's."""

from __future__ import annotations

import json

import pytest

from benchmarks.kernels import gpu_gmm_sweep
from pallas_kernels import compat


def _run(tmp_path, impls=None):
  path = tmp_path / "sweep.json"
  argv = ["--tiny", "--json", str(path)] + (["--impls", impls] if impls else [])
  assert gpu_gmm_sweep.main(argv) == 0
  return json.loads(path.read_text())


def _check(result, impls):
  rows = result["rows"]
  assert "gpu_gmm_sweep --tiny" in result["metadata"]["command"]
  assert not [r for r in rows if "error" in r or "skipped" in r], rows
  for pass_ in gpu_gmm_sweep.PASSES:
    ran = {r["impl"] for r in rows if r["pass"] == pass_}
    assert ran == impls, (pass_, ran)
    for r in rows:
      if r["pass"] == pass_ and r["impl"] != "xla_dense":
        assert r["ok"] and r["rel_err"] <= gpu_gmm_sweep.TOL and r["of_dense"] > 0, r
  assert {(b["shape"], b["pass"]) for b in result["best"]} == {
      ("tiny", p) for p in gpu_gmm_sweep.PASSES}


def test_tiny_sweep_times_the_references(tmp_path):
  """The harness: XLA's dense dot and ragged_dot (and its transposes) through the timed loop."""
  _check(_run(tmp_path, impls="xla_dense"), {"xla_dense", "xla_ragged_dot"})


@pytest.mark.slow   # interpreted kernels: ~90 s on the 2-core VM
def test_tiny_sweep_runs_every_candidate(tmp_path):
  impls = {"xla_dense", "xla_ragged_dot", "triton"}
  if compat.mosaic_gpu_interpret() is not None:
    impls.add("hopper")
  _check(_run(tmp_path), impls)
