"""End-to-end tests of the trainer and train.py on the 8 fake CPU devices, with a tiny model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moejax.config import (
  Config,
)
from moejax.train import metrics as metrics_lib
from moejax.train.programs import xla_memory
from moejax.train.trainer import Trainer
from tests.run_config import (
  REPO_ROOT,
  TOKENS,
  TOP_K,
  checkpoint_steps,
  read_jsonl,
  step_losses,
  tiny_config,
)


@pytest.mark.slow   # with the fresh venv's install, over the 8-minute budget
def test_run_writes_metrics_checkpoints_and_learns(tmp_path):
  cfg = tiny_config(tmp_path, num_steps=8, every=3, keep=2, eval_every=4, warmup_steps=2)
  with Trainer(cfg) as trainer:
    summary = trainer.run()
    xla = xla_memory(trainer.pool.program.train_step)
  assert summary["start_step"] == 0
  assert summary["first"]["step"] == 0 and summary["last"]["step"] == 7

  records = read_jsonl(tmp_path / "metrics.jsonl")
  steps = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in steps] == list(range(8))
  assert [r["step"] for r in evals] == [3, 7]
  assert all(np.isfinite(r["eval_loss"]) and r["eval_loss"] > 0 for r in evals)

  num_moe_layers = cfg.model.num_layers // cfg.moe.moe_every
  for r in steps:
    assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"])
    assert len(r["moe"]) == num_moe_layers
    for layer, m in enumerate(r["moe"]):
      assert m["layer"] == layer
      assert len(m["expert_counts"]) == cfg.moe.num_experts
      assert sum(m["expert_counts"]) == TOKENS * TOP_K
      assert all(c >= 0 for c in m["expert_counts"])
      # data=2 rows x expert=4 devices; every choice lands on exactly one device.
      assert len(m["device_load"]) == 8
      assert sum(m["device_load"]) == TOKENS * TOP_K
      assert m["max_over_mean_load"] >= 1.0
      assert 0.0 <= m["dropped_fraction"] <= 1.0
      assert np.isfinite(m["balance_loss"]) and m["balance_loss"] > 0
      assert np.isfinite(m["z_loss"]) and m["z_loss"] >= 0

  # Saved at 3 and 6 during the run and at 8 at the end; keep=2 leaves the last two.
  assert checkpoint_steps(tmp_path) == [6, 8]
  # config.json is the config the run ran with: the schedule's horizon resolved (0: num_steps)
  ran = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=8))
  with open(tmp_path / "config.json") as f:
    assert json.load(f) == json.loads(json.dumps(ran.to_dict()))
  # memory.txt reports XLA's analysis of the executable that trained, then the arithmetic.
  memory_txt = (tmp_path / "memory.txt").read_text().splitlines()
  assert memory_txt[0] == ("XLA compiled train step ep/2x4x1/cf1.25, bytes per device: " +
                           ", ".join(f"{k} {v}" for k, v in xla.items()))
  assert xla["argument"] > 0 and xla["temp"] > 0
  assert memory_txt[1].startswith("arithmetic model, expert memory per device")
  assert steps[-1]["loss"] < steps[0]["loss"]
  # The run's layout is static, so the static layout's drops and realised work predicted from
  # the counts must be what the compiled program reported.
  balance = summary["balance"]
  assert balance["from_step"] == 4
  assert balance["dropped_fraction"] == balance["static_dropped_fraction"]
  assert np.isclose(balance["realised_max_over_mean"], balance["static_realised_max_over_mean"])


def _run(cfg: Config) -> tuple[int, list[dict]]:
  with Trainer(cfg) as trainer:
    summary = trainer.run()
  return summary["start_step"], read_jsonl(os.path.join(cfg.train.run_dir, "metrics.jsonl"))


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_resume_is_exact(tmp_path):
  # warmup_steps > num_steps keeps the LR schedule identical for num_steps=3 and 6.
  dir_a, dir_b = tmp_path / "a", tmp_path / "b"
  start_a, rec_a = _run(tiny_config(dir_a, num_steps=6, every=3, keep=3))
  assert start_a == 0
  assert checkpoint_steps(dir_a) == [3, 6]

  cfg_b = tiny_config(dir_b, num_steps=3, every=3, keep=3)
  start_b, _ = _run(cfg_b)
  assert start_b == 0
  assert checkpoint_steps(dir_b) == [3]
  start_b2, rec_b = _run(dataclasses.replace(
      cfg_b, train=dataclasses.replace(cfg_b.train, num_steps=6)))
  assert start_b2 == 3
  assert checkpoint_steps(dir_b) == [3, 6]

  loss_a, loss_b = step_losses(rec_a), step_losses(rec_b)
  assert sorted(loss_a) == list(range(6)) and sorted(loss_b) == list(range(6))
  np.testing.assert_allclose([loss_b[s] for s in range(3)], [loss_a[s] for s in range(3)],
                             rtol=1e-6)
  np.testing.assert_allclose([loss_b[s] for s in range(3, 6)], [loss_a[s] for s in range(3, 6)],
                             rtol=1e-6)
  # The expert loads of the resumed steps match too (same data, same routing).
  moe_a = {r["step"]: r["moe"] for r in rec_a if "moe" in r}
  moe_b = {r["step"]: r["moe"] for r in rec_b if "moe" in r}
  for s in range(3, 6):
    assert [m["expert_counts"] for m in moe_b[s]] == [m["expert_counts"] for m in moe_a[s]]


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_cli_smoke(tmp_path):
  run_dir = tmp_path / "run"
  bindings = [
      "model.d_model = 32", "model.num_layers = 2", "model.num_heads = 2", "model.d_ff = 64",
      "model.max_seq_len = 32", "moe.num_experts = 8", "moe.top_k = 2", "moe.d_ff = 32",
      "moe.moe_every = 2", "data.seq_len = 32", "data.global_batch_size = 8",
      "data.max_corpus_bytes = 200000", "mesh.data = 2", "mesh.expert = 4", "mesh.model = 1",
      "train.num_steps = 4", f"train.run_dir = '{run_dir}'", "train.progress_bar = False",
      "train.eval_batches = 2", "moe.capacity = 'device'",
  ]
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)   # train.py must fake the 8 host devices itself
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "train.py", *(f"--gin_bindings={b}" for b in bindings)],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "steps 0..3" in proc.stdout
  # The planner's first plan comes from the first finished step (cold start): the layout
  # the comparison reports is the re-placed one, and the metrics record each switch.
  line = proc.stdout.strip().splitlines()[-1]
  assert line.startswith("balance from step 2 (smartmoe placement, capacity per device)"), line
  dropped, static = [float(w.rstrip("%")) for w in line.split() if w.endswith("%")]
  assert 0 <= dropped <= 100 and 0 <= static <= 100, line
  assert (run_dir / "operative_config.gin").is_file()
  assert "train.num_steps = 4" in (run_dir / "operative_config.gin").read_text()
  records = read_jsonl(run_dir / "metrics.jsonl")
  assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]
  assert any("eval_loss" in r for r in records)
  # The first plan came after step 0 finished, well before `planner.every`; it switches only
  # where a permutation beats static by `min_gain` on that one step, so a switch, if any, is
  # before step 2 (the plan was due before step 1, applied by step 2).
  with open(run_dir / "checkpoints" / "4" / "meta" / "metadata") as f:
    assert json.load(f)["planner"]["planned"], "no cold-start plan within 4 steps"
  switches = [r for r in records if r.get("event") == "layout_switch"]
  assert all(r["step"] <= 2 for r in switches), switches
  assert checkpoint_steps(run_dir) == [4]


def test_metrics_writer_drops_records_past_the_resume_step(tmp_path):
  path = str(tmp_path / "m.jsonl")
  w = metrics_lib.JsonlWriter(path)
  for s in range(5):
    w.write({"step": s, "loss": float(s)})
  w.close()
  with open(path, "a") as f:
    f.write('{"step": 5, "lo')          # a torn line from a killed run
  w = metrics_lib.JsonlWriter(path, start=3)
  w.write({"step": 3, "loss": 30.0})
  w.close()
  with open(path) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == [0, 1, 2, 3]
