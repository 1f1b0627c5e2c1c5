"""`python -m moejax.evaluate RUN_DIR`: the latest intact checkpoint's loss on the trainer's own
eval batches equals the eval loss the trainer recorded at that step; the whole split, given
data and another mesh evaluate too; the routing statistics are training's records over the
data; a run dir without a checkpoint is one line."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from moejax import evaluate as evaluate_cli
from moejax.train import data as data_lib
from tests import run_helpers
from tests.run_config import read_jsonl, tiny_config

STEPS = 3


@pytest.fixture(scope="module")
def _trained(tmp_path_factory) -> str:
  """The tiny run of the trainer tests, 3 steps: saved at step 3, after which the trainer
  evaluated 2 batches (train.eval_batches) on that state."""
  run_dir = str(tmp_path_factory.mktemp("evaluate") / "run")
  run_helpers.run_in_process(tiny_config(run_dir, num_steps=STEPS, every=100))
  return run_dir


@pytest.fixture
def trained_run(_trained, tmp_path):
  run_dir = tmp_path / "run"
  shutil.copytree(_trained, run_dir)
  return run_dir


def _result(capsys, path) -> tuple[str, dict]:
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 1, out
  with open(path) as f:
    return out[0], json.load(f)


def test_evaluate_equals_the_trainers_eval_loss_on_the_same_batches(trained_run, capsys):
  recorded = [r for r in read_jsonl(trained_run / "metrics.jsonl") if "eval_loss" in r]
  assert [r["step"] for r in recorded] == [STEPS - 1]
  assert evaluate_cli.main([str(trained_run), "--batches", "2"]) == 0
  line, result = _result(capsys, trained_run / evaluate_cli.JSON_NAME)
  assert result["step"] == STEPS and result["batches"] == 2
  assert result["loss"] == recorded[0]["eval_loss"], (result["loss"], recorded[0])
  assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
  assert line.startswith(f"step 3 of {trained_run}: loss {result['loss']:.4f}, perplexity "
                         f"{result['perplexity']:.2f} on the val split of the embedded corpus "
                         "(2 batches, 512 tokens, ep/2x4x1/cf1.25); routing: "), line
  # The routing of the same pass: training's per-layer record over both batches.
  (layer,) = result["layers"]     # 2 layers, an MoE block every 2nd
  choices = 2 * 8 * 32 * 2        # batches x rows x positions x top-k
  assert sum(layer["expert_counts"]) == choices and sum(layer["device_load"]) == choices
  assert result["dropped_fraction"] == pytest.approx(layer["dropped_fraction"], abs=0)
  assert 0 <= result["dropped_fraction"] < 1
  assert result["max_over_mean_load"] == layer["max_over_mean_load"] >= 1
  assert result["realised_max_over_mean"] == layer["realised_max_over_mean"] >= 1
  assert not os.path.exists(trained_run / "run.lock")


@pytest.mark.slow   # four evaluations, one on another mesh (a compile): half a minute more
def test_the_whole_split_other_data_and_another_mesh(trained_run, tmp_path, capsys):
  """Default: every whole batch of the validation split, each window once. Given data is
  read as data.path is. --mesh evaluates the same checkpoint on fewer devices."""
  cfg = evaluate_cli.run_config(str(trained_run))
  _, val, _ = data_lib.load_tokens(cfg.data)
  windows = (len(val) - 1) // cfg.data.seq_len
  out = str(tmp_path / "whole.json")
  assert evaluate_cli.main([str(trained_run), "--json", out]) == 0
  _, whole = _result(capsys, out)
  assert whole["batches"] == windows // cfg.data.global_batch_size > 2
  assert evaluate_cli.main([str(trained_run), "--batches", str(whole["batches"] + 1)]) == 2
  assert f"the val split has {whole['batches']} whole batches" in capsys.readouterr().err

  text = tmp_path / "text.txt"
  text.write_bytes(bytes(val[:6000]))
  assert evaluate_cli.main([str(trained_run), "--data", str(text), "--json", out]) == 0
  line, given = _result(capsys, out)
  assert given["data"] == str(text) and f"on the val split of {text} " in line, line
  assert math.isfinite(given["loss"]) and given["batches"] >= 1

  assert evaluate_cli.main([str(trained_run), "--batches", "2", "--json", out]) == 0
  _, eight = _result(capsys, out)
  assert evaluate_cli.main([str(trained_run), "--batches", "2", "--mesh", "1,4,1",
                            "--json", out]) == 0
  _, four = _result(capsys, out)
  assert (four["strategy"], four["step"]) == ("ep/1x4x1/cf1.25", eight["step"])
  # The same weights and batches on 4 of the 8 devices: each device's capacity buffers
  # differ, and so may the choices they drop; the loss stays near.
  assert four["loss"] == pytest.approx(eight["loss"], rel=0.05), (four["loss"], eight["loss"])
  assert evaluate_cli.main([str(trained_run), "--mesh", "2,8,1", "--json", out]) == 2
  assert "--mesh asks for 16 devices but there are 8" in capsys.readouterr().err


def test_a_run_dir_without_a_checkpoint_or_config_is_one_line(tmp_path, capsys):
  assert evaluate_cli.main([str(tmp_path / "nothing")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: RUN_DIR ") and "has no config.json" in err, err
  assert not (tmp_path / "nothing").exists()
  run = tmp_path / "run"
  run.mkdir()
  cfg = tiny_config(run, num_steps=3, every=100)
  (run / "config.json").write_text(json.dumps(cfg.to_dict()))
  assert evaluate_cli.main([str(run), "--batches", "1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "holds no checkpoint yet" in err[0], err
  assert os.listdir(run) == ["config.json"]
