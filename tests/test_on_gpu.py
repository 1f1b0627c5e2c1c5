"""The prepared GPU run's dry run: every step that needs no GPU runs at a tiny size on CPU,
the others say why they were skipped, and the JSON carries what a GPU run's would."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.gpu.gpu_train_step import flops_per_token, load_config


def test_flops_per_token_counts_active_experts_only():
  """Twice the experts at the same top-k and width adds only the router's FLOPs."""
  import dataclasses
  cfg = load_config(True, 1)
  experts = cfg.moe.num_experts
  more = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=2 * experts))
  router = 6 * cfg.model.d_model * experts * (cfg.model.num_layers // cfg.moe.moe_every)
  assert flops_per_token(more) - flops_per_token(cfg) == router


@pytest.mark.slow   # builds and times nine tiny train steps (~2-4 min on two cores)
def test_dry_run_reports_every_step(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.on_gpu", "--dry_run", "--budget_s",
                         "900", "--out", str(tmp_path)], capture_output=True, text=True,
                        env=env, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads((tmp_path / "on_gpu_cpu.json").read_text())
  assert {"command", "commit", "date", "machine", "load"} <= set(result["metadata"])
  steps = result["steps"]
  for name in ("target_config", "kernel_tests", "mock_topology", "schedule_estimate"):
    assert steps[name]["skipped"].startswith("no GPU"), steps[name]
  rows = {r["path"]: r for r in steps["train_steps"]["rows"]}
  assert set(rows) == {"dense/xla", "ragged/pallas", "pooled/pallas", "fsep/xla",
                       "dense_equivalent"}
  assert "XLA:CPU does not implement" in rows["ragged/pallas"]["error"]
  for name, row in rows.items():
    if name != "ragged/pallas":
      assert row["error"] is None and row["step_s_median"] > 0 and row["steps_timed"] >= 4, row
  ablations = {r["path"] for r in steps["train_steps"]["ablations"]}
  assert any(p.endswith("plain loss") for p in ablations)
  assert (tmp_path / "best_step_hlo.txt.gz").exists()   # the fastest path's scheduled HLO
