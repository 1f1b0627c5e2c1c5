"""`python -m moejax.convert` as a new user meets it: a hub id or a missing directory is one
`error:` line that says what to give; a conversion that fails leaves nothing of its output
behind; what `to_hf` writes is what the guide says it writes."""

from __future__ import annotations

import json
import os
import re

import pytest

from moejax.convert import __main__ as cli
from tests.run_config import REPO_ROOT

GUIDE = os.path.join(REPO_ROOT, "docs", "guide", "start-from-a-published-model.md")
TINY_MIXTRAL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
                    num_local_experts=8, intermediate_size=32)


def _error_line(capsys) -> str:
  captured = capsys.readouterr()
  lines = [line for line in captured.err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
  assert "Traceback" not in captured.err and not captured.out, captured
  return lines[0]


def _tree(path) -> list[str]:
  return sorted(os.path.relpath(os.path.join(root, n), path)
                for root, dirs, files in os.walk(path) for n in dirs + files)


def test_a_hub_id_or_a_missing_directory_is_one_line_that_says_what_to_give(tmp_path, capsys,
                                                                            monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert cli.main(["from_hf", "mistralai/Mixtral-8x7B-v0.1", "runs/mixtral"]) == 2
  line = _error_line(capsys)
  assert "'mistralai/Mixtral-8x7B-v0.1' is not a directory" in line, line
  assert "hf download mistralai/Mixtral-8x7B-v0.1 --local-dir Mixtral-8x7B-v0.1" in line, line
  assert cli.main(["from_hf", str(tmp_path / "nowhere"), "runs/x"]) == 2
  line = _error_line(capsys)
  assert f"{str(tmp_path / 'nowhere')!r} is not a directory" in line, line
  assert "save_pretrained" in line and "not from the hub" not in line, line
  (tmp_path / "empty").mkdir()
  assert cli.main(["from_hf", "empty", "runs/x"]) == 2
  assert "'empty' has no config.json" in _error_line(capsys)
  assert sorted(os.listdir(tmp_path)) == ["empty"]     # no run dir was started


def test_the_help_names_the_command_and_the_default_mesh(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  text = capsys.readouterr().out
  assert text.startswith("usage: python -m moejax.convert "), text
  assert "__main__" not in text and "(to_hf)." in " ".join(text.split()), text
  with pytest.raises(SystemExit):
    cli.main(["from_hf", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert text.startswith("usage: python -m moejax.convert from_hf "), text
  assert "(default 1,8,1)" in text, text


def _config_only(tmp_path):
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text(json.dumps(dict(
      TINY_MIXTRAL, model_type="mixtral", hidden_act="silu", rms_norm_eps=1e-5,
      rope_theta=1e6)))
  return hf


def test_a_failed_from_hf_leaves_nothing_behind(tmp_path, capsys):
  """A config without weights fails after the checkpoint directory was made: a new run dir
  (and the parents made for it) goes again; in a directory that was there, only what the
  conversion added goes."""
  hf = _config_only(tmp_path)
  new = tmp_path / "runs" / "a" / "mixtral"
  assert cli.main(["from_hf", str(hf), str(new), "--mesh", "1,4,1"]) == 2
  assert "holds no model.safetensors" in _error_line(capsys)
  assert sorted(os.listdir(tmp_path)) == ["hf"]
  existing = tmp_path / "mine"
  existing.mkdir()
  (existing / "notes.txt").write_text("mine")
  assert cli.main(["from_hf", str(hf), str(existing), "--mesh", "1,4,1"]) == 2
  _error_line(capsys)
  assert _tree(existing) == ["notes.txt"]


def _saved_mixtral(root):
  transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
  torch = pytest.importorskip("torch", reason="the hf extra is not installed")
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**TINY_MIXTRAL))
  path = os.path.join(root, "mixtral")
  model.save_pretrained(path, max_shard_size="60KB")
  return path


def test_a_mesh_the_experts_do_not_divide_is_one_line_and_leaves_no_run_dir(tmp_path, capsys):
  hf = _saved_mixtral(str(tmp_path))
  capsys.readouterr()   # transformers' progress bar
  run = tmp_path / "run"
  assert cli.main(["from_hf", hf, str(run), "--mesh", "1,3,1"]) == 2
  line = _error_line(capsys)
  assert "moe.num_experts=8" in line and "expert axis size 3" in line, line
  assert not run.exists()


def _guide_way_out() -> str:
  with open(GUIDE) as f:
    text = f.read()
  return text.split("## The way out", 1)[1].split("\n## ", 1)[0]


def test_to_hf_writes_the_files_the_guide_names(tmp_path, capsys):
  """One model.safetensors and no index below --max_shard_gib; above it numbered shards and
  their index. The guide's section names exactly these."""
  hf = _saved_mixtral(str(tmp_path))
  run = str(tmp_path / "run")
  assert cli.main(["from_hf", hf, run, "--mesh", "1,4,1", "--dtype", "float32"]) == 0
  one, many = str(tmp_path / "one"), str(tmp_path / "many")
  assert cli.main(["to_hf", run, one]) == 0
  assert cli.main(["to_hf", run, many, "--max_shard_gib", str(60e3 / 2**30)]) == 0
  capsys.readouterr()
  weights_one = sorted(n for n in os.listdir(one) if "safetensors" in n)
  weights_many = sorted(n for n in os.listdir(many) if "safetensors" in n)
  assert weights_one == ["model.safetensors"], weights_one
  shards = [n for n in weights_many if n.endswith(".safetensors")]
  assert len(shards) > 1 and "model.safetensors.index.json" in weights_many, weights_many
  assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", n)
             for n in shards), shards
  section = _guide_way_out()
  named = set(re.findall(r"`(model[\w.-]*\.(?:safetensors|json))`", section))
  assert named == {"model.safetensors", "model-0000i-of-0000n.safetensors",
                   "model.safetensors.index.json"}, named
  assert "config.json" in os.listdir(one) and "config.json" in os.listdir(many)


def test_a_converted_model_evaluates_on_given_data_and_not_on_the_byte_corpus(tmp_path,
                                                                             capsys):
  """The weights-only checkpoint from_hf writes evaluates (`python -m moejax.evaluate`) on data
  in the model's vocabulary; without --data it is the one-line error of a converted model on
  the byte corpus."""
  import numpy as np

  from moejax import evaluate as evaluate_cli

  hf = _saved_mixtral(str(tmp_path))
  run = str(tmp_path / "run")
  assert cli.main(["from_hf", hf, run, "--mesh", "2,4,1", "--dtype", "float32"]) == 0
  capsys.readouterr()
  assert evaluate_cli.main([run, "--batches", "1"]) == 2
  assert "data.path is unset, so the data is the built-in byte corpus" in _error_line(capsys)
  tokens = str(tmp_path / "tokens.npy")
  np.save(tokens, np.random.default_rng(0).integers(0, 128, 200_000).astype(np.uint16))
  assert evaluate_cli.main([run, "--data", tokens, "--batches", "2"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 1 and out[0].startswith(f"step 0 of {run}: loss "), out
  with open(os.path.join(run, "eval.json")) as f:
    result = json.load(f)
  assert result["strategy"].startswith("ep/2x4x1/") and result["batches"] == 2
  assert abs(result["loss"] - np.log(128)) < 1.0, result["loss"]   # random weights: near uniform
