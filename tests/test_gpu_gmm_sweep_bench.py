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


def test_a_device_fault_stops_the_sweep_and_names_the_faulting_kernel(monkeypatch):
  """A kernel that faults on the device leaves the CUDA context unusable (the H200 run's
  Hopper kernel: CUDA_ERROR_MISALIGNED_ADDRESS); the candidates after it are marked not run,
  naming the one that faulted, not given its error as their own."""
  real = gpu_gmm_sweep.timed
  calls = []

  def faulting(run, args, want, tiny):
    calls.append(run)
    if len(calls) == 2:   # ragged_dot of the first pass, after the dense dot
      raise RuntimeError("INTERNAL: CUDA error: CUDA_ERROR_MISALIGNED_ADDRESS: misaligned")
    return real(run, args, want, tiny)

  monkeypatch.setattr(gpu_gmm_sweep, "timed", faulting)
  monkeypatch.setattr(gpu_gmm_sweep, "device_usable", lambda: len(calls) != 2)
  rows = gpu_gmm_sweep.sweep(gpu_gmm_sweep.TINY_SHAPES, True, 600, 4, lambda rows: None,
                             impls={"xla_dense", "xla_ragged_dot"})
  assert len(calls) == 2 and "ms" in rows[0] and "CUDA_ERROR" in rows[1]["error"]
  assert len(rows) == 2 * len(gpu_gmm_sweep.PASSES)
  assert all(r["skipped"].startswith("not run: tiny fwd xla_ragged_dot {} faulted")
             for r in rows[2:]), rows[2:]


def test_an_error_that_leaves_the_device_usable_stops_only_its_candidate(monkeypatch):
  """Out of memory, say: the device still runs, so the next candidates do too."""
  real = gpu_gmm_sweep.timed
  calls = []

  def failing(run, args, want, tiny):
    calls.append(run)
    if len(calls) == 2:
      raise RuntimeError("RESOURCE_EXHAUSTED: CUDA_ERROR_OUT_OF_MEMORY: out of memory")
    return real(run, args, want, tiny)

  monkeypatch.setattr(gpu_gmm_sweep, "timed", failing)
  rows = gpu_gmm_sweep.sweep(gpu_gmm_sweep.TINY_SHAPES, True, 600, 4, lambda rows: None,
                             impls={"xla_dense", "xla_ragged_dot"})
  assert "error" in rows[1] and gpu_gmm_sweep.device_usable()
  assert len(calls) == len(rows) == 2 * len(gpu_gmm_sweep.PASSES)
  assert all("ms" in r for i, r in enumerate(rows) if i != 1), rows
