"""The prepared GPU run's dry run: every step that needs no GPU runs at a tiny size on CPU,
the others say why they were skipped, and the JSON carries what a GPU run's would."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from benchmarks.gpu import on_gpu
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
                         "1800", "--out", str(tmp_path)], capture_output=True, text=True,
                        env=env, timeout=2400)   # a loaded host builds slowly: budget to spare
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads((tmp_path / "on_gpu_cpu.json").read_text())
  assert {"command", "commit", "date", "machine", "load"} <= set(result["metadata"])
  steps = result["steps"]
  assert list(steps) == list(on_gpu.STEPS)       # the names --skip takes, in their order
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
  with gzip.open(tmp_path / "step_hlos.json.gz", "rt") as f:   # each shape's fastest path's
    assert "ENTRY" in json.load(f)["gpu_config"]              # scheduled HLO


def test_skip_names_an_unknown_step_in_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    on_gpu.main(["--skip", "rates,train_step", "--dry_run"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--skip train_step: no such step" in err and "train_steps" in err, err


def test_flops_per_token_counts_grouped_kv_heads_and_head_dim():
  """Mixtral's cut (GQA 32/8 of dim 128): q and o are d x 4096 each, k and v d x 1024 each;
  Qwen3's (head dim 128 x 32 heads = 4096, twice d_model): the scores span H x Dh, not d."""
  import dataclasses
  cfg = load_config(False, 1, "mixtral_2l")
  fewer_kv = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_kv_heads=4))
  d, layers = cfg.model.d_model, cfg.model.num_layers
  assert flops_per_token(cfg) - flops_per_token(fewer_kv) == 6 * layers * 2 * d * 4 * 128
  qwen = load_config(False, 1, "qwen3_4l")
  m = qwen.model
  wider = dataclasses.replace(qwen, model=dataclasses.replace(m, head_dim=2 * m.head_dim))
  width = m.num_heads * m.head_dim
  extra = m.num_layers * (6 * (2 * m.d_model * width + 2 * m.d_model * m.num_kv_heads *
                                m.head_dim) + 6 * qwen.data.seq_len * width)
  assert flops_per_token(wider) - flops_per_token(qwen) == extra
