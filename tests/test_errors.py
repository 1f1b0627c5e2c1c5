"""Every bad input gets a one-line ConfigError naming the offending value and the fix."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moejax.config import (
  CheckpointConfig,
  Config,
  ConfigError,
  DataConfig,
  MeshConfig,
  ModelConfig,
  MoEConfig,
  TrainConfig,
)
from moejax.layout import tables as layout_lib
from moejax.model import mesh as mesh_lib
from moejax.train import data as data_lib
from moejax.train.trainer import Trainer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

import train  # noqa: E402  (the CLI module at the repo root)
from tests.helpers import our_stderr_lines  # noqa: E402


def assert_one_line(excinfo, *needles: str) -> str:
  msg = str(excinfo.value)
  assert msg and "\n" not in msg and msg == msg.strip(), repr(msg)
  for needle in needles:
    assert needle in msg, f"{needle!r} not in {msg!r}"
  return msg


def tiny_config(tmp_path, **parts) -> Config:
  """A tiny valid config on the 8 fake devices (data=2 x expert=4); `parts` replace pieces."""
  base = dict(
      mesh=MeshConfig(data=2, expert=4, model=1),
      model=ModelConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_seq_len=32),
      moe=MoEConfig(num_experts=8, top_k=2, d_ff=32, moe_every=2),
      train=TrainConfig(run_dir=str(tmp_path / "run"), num_steps=1, progress_bar=False))
  base.update(parts)
  if "data" not in base:
    base["data"] = DataConfig(path=str(token_file(tmp_path)), seq_len=32, global_batch_size=8)
  return Config(**base)


def token_file(tmp_path, max_token: int = 200, n: int = 20_000):
  path = tmp_path / f"tokens_{max_token}.npy"
  tokens = np.arange(n, dtype=np.uint16) % (max_token + 1)
  np.save(path, tokens)
  return path


# --- mesh ---------------------------------------------------------------------------------------

def test_mesh_product_mismatch():
  with pytest.raises(ConfigError) as e:
    MeshConfig(data=3, expert=2, model=1).resolve(8)
  msg = assert_one_line(e, "'data': 3", "'expert': 2", "multiply to 6", "8 devices")
  assert "-1" in msg   # the fix: make the product 8 or set one axis to -1


def test_mesh_product_mismatch_through_build_mesh():
  with pytest.raises(ConfigError) as e:
    mesh_lib.build_mesh(MeshConfig(data=3, expert=2, model=1))
  assert_one_line(e, "'data': 3", "multiply to 6", "8 devices")


def test_mesh_minus_one_cannot_fill():
  with pytest.raises(ConfigError) as e:
    MeshConfig(data=-1, expert=3, model=1).resolve(8)
  assert_one_line(e, "'expert': 3", "8 devices", "not divisible by 3")


def test_mesh_two_minus_ones():
  with pytest.raises(ConfigError) as e:
    MeshConfig(data=-1, expert=-1, model=1).resolve(8)
  assert_one_line(e, "'data': -1", "'expert': -1", "more than one -1", "set all but one")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(data=0, expert=4, model=1), "mesh.data=0"),
    (dict(data=2, expert=0, model=1), "mesh.expert=0"),
    (dict(data=-1, expert=4, model=-2), "mesh.model=-2"),
])
def test_mesh_zero_or_negative_size(kwargs, needle):
  with pytest.raises(ConfigError) as e:
    MeshConfig(**kwargs).resolve(8)
  assert_one_line(e, needle, "positive size or -1")


# --- experts over the expert axis ---------------------------------------------------------------

def test_experts_not_divisible_by_expert_axis():
  with pytest.raises(ConfigError) as e:
    layout_lib.slots_per_device(6, 4)
  assert_one_line(e, "moe.num_experts=6", "expert axis size 4", "multiple of mesh.expert")
  with pytest.raises(ConfigError) as e:
    layout_lib.static_layout(2, 6, 4)
  assert_one_line(e, "moe.num_experts=6", "4")


def test_experts_not_divisible_through_trainer(tmp_path):
  cfg = tiny_config(tmp_path, moe=MoEConfig(num_experts=6, top_k=2, d_ff=32, moe_every=2))
  with pytest.raises(ConfigError) as e:
    Trainer(cfg)
  assert_one_line(e, "moe.num_experts=6", "expert axis size 4")


# --- MoE config ---------------------------------------------------------------------------------

def test_top_k_above_num_experts():
  with pytest.raises(ConfigError) as e:
    Config(moe=MoEConfig(num_experts=8, top_k=9)).validate()
  assert_one_line(e, "moe.top_k=9", "moe.num_experts=8", "lower top_k or add experts")


@pytest.mark.parametrize("factor", [0, -1, 0.0])
def test_capacity_factor_not_positive(factor):
  with pytest.raises(ConfigError) as e:
    Config(moe=MoEConfig(capacity_factor=factor)).validate()
  assert_one_line(e, f"moe.capacity_factor={factor}", "must be > 0", "1.25")


@pytest.mark.parametrize("train_kw,ckpt_kw,needle", [
    (dict(eval_every=0), {}, "train.eval_every=0"),
    (dict(eval_batches=0), {}, "train.eval_batches=0"),
    (dict(num_steps=-1), {}, "train.num_steps=-1"),
    ({}, dict(every=0), "checkpoint.every=0"),
    ({}, dict(keep=0), "checkpoint.keep=0"),
])
def test_loop_settings_out_of_range(train_kw, ckpt_kw, needle):
  with pytest.raises(ConfigError) as e:
    Config(train=TrainConfig(**train_kw), checkpoint=CheckpointConfig(**ckpt_kw)).validate()
  assert_one_line(e, needle, "must be >=")


# --- data ---------------------------------------------------------------------------------------

def test_missing_data_path(tmp_path):
  missing = str(tmp_path / "nope.npy")
  with pytest.raises(ConfigError) as e:
    data_lib.load_tokens(DataConfig(path=missing))
  assert_one_line(e, f"data.path={missing!r}", "does not exist", "leave data.path unset")


def test_missing_data_path_through_trainer(tmp_path):
  missing = str(tmp_path / "nope.bin")
  cfg = tiny_config(tmp_path, data=DataConfig(path=missing, seq_len=32, global_batch_size=8))
  with pytest.raises(ConfigError) as e:
    Trainer(cfg)
  assert_one_line(e, f"data.path={missing!r}", "does not exist")


def test_batch_not_divisible_by_data_times_expert(tmp_path):
  cfg = tiny_config(tmp_path, data=DataConfig(path=str(token_file(tmp_path)), seq_len=32,
                                              global_batch_size=12))
  with pytest.raises(ConfigError) as e:
    Trainer(cfg)
  assert_one_line(e, "data.global_batch_size=12", "data*expert=8", "multiple of 8")


def test_vocab_smaller_than_data(tmp_path):
  path = token_file(tmp_path, max_token=300)
  cfg = tiny_config(tmp_path, data=DataConfig(path=str(path), seq_len=32, global_batch_size=8))
  assert cfg.model.vocab_size == 256
  with pytest.raises(ConfigError) as e:
    Trainer(cfg)
  assert_one_line(e, "token ids up to 300", "model.vocab_size=256", "model.vocab_size >= 301")


def test_a_converted_model_without_data_path_stops_and_one_from_scratch_is_warned(tmp_path):
  """data.path left out (an easy slip): the data is the byte corpus. A model with another
  vocabulary from train.init_from's weights stops before anything compiles; one trained from
  scratch is told that its other ids never occur."""
  init = tmp_path / "converted"
  (init / "hf").mkdir(parents=True)
  (init / "hf" / "tokenizer.json").write_text("{}")
  model = ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                      max_seq_len=32)
  data = DataConfig(seq_len=32, global_batch_size=8, max_corpus_bytes=200_000)
  cfg = tiny_config(tmp_path, model=model, data=data, train=TrainConfig(
      run_dir=str(tmp_path / "run"), init_from=str(init), num_steps=1, progress_bar=False))
  with pytest.raises(ConfigError) as e:
    Trainer(cfg)
  assert_one_line(e, "data.path is unset", "byte corpus (vocab_size=256)",
                  "model.vocab_size=512", f"train.init_from={str(init)!r}",
                  f"--tokenizer {init / 'hf' / 'tokenizer.json'}")
  assert not (tmp_path / "run").exists()
  scratch = tiny_config(tmp_path, model=model, data=data)
  note = data_lib.byte_corpus_mismatch(scratch)   # what the trainer logs as a warning
  assert note.startswith("data.path is unset: training on the built-in byte corpus"), note
  assert "(vocab_size=256)" in note and "model.vocab_size=512" in note, note
  for fine in (dataclasses.replace(scratch, model=dataclasses.replace(model, vocab_size=256)),
               dataclasses.replace(cfg, data=dataclasses.replace(data, path="d.bin"))):
    assert data_lib.byte_corpus_mismatch(fine) is None


# --- gin / CLI ----------------------------------------------------------------------------------

def test_unknown_gin_parameter():
  with pytest.raises(ConfigError) as e:
    train.parse_config([], ["moe.nope = 1"])
  msg = assert_one_line(e, "'moe'", "'nope'", "Known configurables")
  assert ".." not in msg


def test_unknown_gin_configurable():
  with pytest.raises(ConfigError) as e:
    train.parse_config([], ["nosuch.x = 1"])
  assert_one_line(e, "'nosuch'", "Known configurables: mesh, model, moe")


def test_unparsable_gin_binding():
  with pytest.raises(ConfigError) as e:
    train.parse_config([], ["moe.top_k = 'unterminated"])
  assert_one_line(e, "bad gin binding", "Known configurables")


def test_missing_gin_file(tmp_path):
  missing = str(tmp_path / "nope.gin")
  with pytest.raises(ConfigError) as e:
    train.parse_config([missing], [])
  assert_one_line(e, missing, "does not exist")


@pytest.mark.parametrize("binding,needle", [
    ("model.d_model = 'abc'", "model.d_model='abc'"),
    ("moe.top_k = 2.5", "moe.top_k=2.5"),
    ("train.progress_bar = 0", "train.progress_bar=0"),
    ("mesh.data = None", "mesh.data=None"),
])
def test_wrongly_typed_gin_binding(binding, needle):
  with pytest.raises(ConfigError) as e:
    train.parse_config([], [binding])
  assert_one_line(e, needle, "must be")


def test_parse_config_accepts_ints_for_floats():
  cfg = train.parse_config([], ["moe.capacity_factor = 2", "data.path = 'x.npy'"])
  assert cfg.moe.capacity_factor == 2 and cfg.data.path == "x.npy"


@pytest.mark.parametrize("args,needle", [
    (["--gin_bindings=moe.nope = 1"], "'nope'"),
    (["--gin_bindings=moe.top_k = 9"], "moe.top_k=9"),
    (["--gin_file=/nonexistent/x.gin"], "/nonexistent/x.gin"),
])
def test_cli_bad_input_exits_2_with_one_line(args, needle):
  proc = subprocess.run([sys.executable, "train.py", *args], cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 2, (proc.stdout, proc.stderr)
  lines = our_stderr_lines(proc.stderr)
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("error:") and needle in lines[0]
  assert "Traceback" not in proc.stderr


# --- plan: nothing fits -------------------------------------------------------------------------

@pytest.mark.slow   # 6.5 s: three re-rankings of the plan
def test_plan_that_fits_nothing_prints_why_and_the_smallest_changes(capsys):
  """The GPU config's global batch of 64 cannot cover 1024 devices: the table, one line per kind
  of rejection, the changes that would make one fit; and those changes do."""
  from moejax import plan as plan_cli

  gin = [f"--gin_file={os.path.join(REPO_ROOT, 'configs', 'gpt_moe_gpu.gin')}",
         "--profile", "h100_cluster"]
  assert plan_cli.main([*gin, "--devices", "1024"]) == 2
  out, err = capsys.readouterr()
  assert err.splitlines() == ["error: no strategy fits this model on 1024 devices; the lines "
                              "above say why and what would make one fit."], err
  lines = out.splitlines()
  assert lines[1].startswith("strategy") and len(lines) > 3971   # the whole table
  # The space: every factorization, mode, factor and dispatch, both expert kernels for dense
  # per-slot buffers (a GPU profile), with pipeline stages (and their microbatch counts) and
  # FSDP where data > 1.
  assert any(line.startswith("1188 of 3971 rejected for global batch over data*expert, e.g. ")
             for line in lines), lines[-4:]
  assert any(line.startswith("2783 of 3971 rejected for model axis divisibility")
             for line in lines), lines[-4:]
  assert lines[-1] == ("smallest changes that make one fit: data.global_batch_size = 256 (a "
                       "multiple of data*expert for some mesh of 1024 devices); or --devices 256 "
                       "(the most devices, halving, on which one fits at "
                       "data.global_batch_size = 64)"), lines[-1]
  assert plan_cli.main([*gin, "--devices", "1024",
                        "--gin_bindings=data.global_batch_size = 256"]) == 0
  assert plan_cli.main([*gin, "--devices", "256"]) == 0
  assert "pool: " in capsys.readouterr().out


# --- what real users type -----------------------------------------------------------------------

@pytest.mark.parametrize("binding,needle", [
    ("data.global_batch_size = -16", "data.global_batch_size=-16 must be >= 1; use e.g. "
     "data.global_batch_size = 16."),
    ("data.seq_len = 0", "data.seq_len=0 must be >= 1"),
    ("data.seq_len = -3", "data.seq_len=-3 must be >= 1"),
    ("optim.learning_rate = -1.0", "optim.learning_rate=-1.0 must be > 0; use e.g."),
    ("optim.b2 = 1.0", "optim.b2=1.0 must be in [0, 1)"),
    ("optim.decay_steps = -5", "optim.decay_steps=-5 must be >= 0"),
    ("mesh.host_device_count = 0", "mesh.host_device_count=0 must be >= 1"),
    ("moe.expert_mode = fsep", "moe.expert_mode = fsep: gin cannot read the bare word fsep; a "
     "string needs quotes: moe.expert_mode = 'fsep'."),
])
def test_bad_values_name_the_knob_and_the_fix(binding, needle):
  with pytest.raises(ConfigError) as e:
    train.parse_config([], [binding])
  assert_one_line(e, needle)


def test_a_mesh_that_cannot_fill_the_devices_names_the_device_count_knob():
  with pytest.raises(ConfigError) as e:
    MeshConfig(data=-1, expert=3).resolve(8)
  assert_one_line(e, "cannot fill 8 devices", "mesh.host_device_count")


def _cli(*args, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                        timeout=300, env=env)


def _one_error_line(proc, needle: str) -> None:
  assert proc.returncode == 2, (proc.stdout, proc.stderr)
  lines = our_stderr_lines(proc.stderr)
  assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


def test_the_tools_say_what_is_wrong_in_one_line(tmp_path):
  np.savez(tmp_path / "empty.npz", counts=np.zeros((0, 2, 8, 8), np.int64))
  _one_error_line(_cli("-m", "moejax.replay", str(tmp_path / "empty.npz"), "--devices", "4",
                       "--slots", "2"), "holds 0 steps")
  _one_error_line(_cli("-m", "moejax.launch", "-n", "2", "--", "nonexistent_cmd"),
                  "command 'nonexistent_cmd' not found")
  _one_error_line(_cli("-m", "moejax.launch", "--bogus"), "unrecognized arguments: --bogus")
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text("")
  _one_error_line(_cli("-m", "moejax.report", str(run)), "holds no step records")
  assert os.listdir(run) == ["metrics.jsonl"]   # no empty plots/
  (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0}) + "\n")
  _one_error_line(_cli("-m", "moejax.report", str(run), "--replay", "notjson"),
                  "--replay notjson: not a readable JSON file")
  assert os.listdir(run) == ["metrics.jsonl"]


@pytest.mark.parametrize("binding,needle", [
    ("mesh.expert = 3", "cannot fill 8 devices"),
    ("moe.num_experts = 6", "moe.num_experts=6 is not divisible"),
])
def test_a_mesh_error_leaves_no_run_dir_and_no_traceback(tmp_path, binding, needle):
  """orbax's start-up thread (clearing a killed save's temporary files) is waited for before
  exit: an error right after start-up once ended in a traceback from it."""
  run = tmp_path / "run"
  proc = _cli("train.py", f"--gin_bindings={binding}", f"--gin_bindings=train.run_dir = '{run}'")
  _one_error_line(proc, needle)
  assert not run.exists()


def test_the_checkpointer_leaves_no_thread_behind(tmp_path):
  import threading

  from moejax.train.checkpoint import Checkpointer

  def orbax_futures():   # the threads of orbax's futures run `_target_setting_result`
    return [t for t in threading.enumerate() if "_target_setting_result" in t.name]

  assert orbax_futures() == []
  ckpt = Checkpointer(str(tmp_path), CheckpointConfig())
  assert orbax_futures() == []
  ckpt.close()
  assert not os.path.exists(tmp_path / "checkpoints")   # nothing written: not left behind


# --- data errors leave nothing behind -----------------------------------------------------------

def _data_cases(tmp_path):
  empty = tmp_path / "empty.bin"
  empty.write_bytes(b"")
  short = tmp_path / "short.txt"
  short.write_text("too short")
  floats = tmp_path / "floats.npy"
  np.save(floats, np.zeros(1000, np.float32))
  return [(f"data.path = '{tmp_path / 'missing.txt'}'", "does not exist"),
          (f"data.path = '{empty}'", "has 0 tokens"),
          (f"data.path = '{short}'", "too few for train and validation"),
          (f"data.path = '{floats}'", "float32 array"),
          (f"data.path = '{token_file(tmp_path)}'", "model.vocab_size=16")]


def test_data_errors_leave_no_lock_and_no_empty_dirs(tmp_path, monkeypatch, capsys):
  """In a fresh run dir nothing is left; in a run dir of earlier runs, no lock."""
  existing = tmp_path / "existing"
  existing.mkdir()
  (existing / "notes.txt").write_text("mine")
  for binding, needle in _data_cases(tmp_path):
    for run in (tmp_path / "fresh", existing):
      rc = train.main([f"--gin_bindings={binding}", "--gin_bindings=model.vocab_size = 16",
                       f"--gin_bindings=train.run_dir = '{run}'"]
                      if "tokens_" in binding else
                      [f"--gin_bindings={binding}", f"--gin_bindings=train.run_dir = '{run}'"])
      err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
      assert rc == 2 and len(err) == 1 and needle in err[0], (binding, err)
      assert not (tmp_path / "fresh").exists(), binding
      assert os.listdir(existing) == ["notes.txt"], (binding, os.listdir(existing))
