"""Faults users cause themselves: a second run on a live run dir, a checkpoint of another model
in the run dir, a full disk, a torn last metrics line. Each ends in one `error:` line or is
repaired, and nothing the first run wrote is lost."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from moejax.config import OptimConfig
from moejax.train import lock as lock_lib, metrics as metrics_lib, optim
from tests import run_helpers
from tests.helpers import our_stderr_lines
from tests.run_config import checkpoint_steps, read_jsonl, step_losses
from tests.run_helpers import reference_losses  # noqa: F401  (fixture)


def _files(run_dir) -> dict[str, bytes]:
  """Every file of a run dir (path -> bytes), checkpoints included."""
  out = {}
  for root, _, names in os.walk(run_dir):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, run_dir)] = f.read()
  return out


# --- the lock itself (host only) ----------------------------------------------------------------

def _write_lock(run_dir, host: str, pid: int) -> None:
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, lock_lib.LOCK_NAME), "w") as f:
    json.dump({"host": host, "pid": pid, "started": "2026-11-24T00:00:00Z"}, f)


def _dead_pid() -> int:
  proc = subprocess.Popen(["true"])
  proc.wait()
  return proc.pid   # reaped: no process has it (until the kernel reuses it, far later)


def test_a_lock_whose_holder_is_gone_is_taken_over_with_a_warning(tmp_path):
  _write_lock(tmp_path, socket.gethostname(), _dead_pid())
  lock = lock_lib.RunDirLock(str(tmp_path))
  warnings = lock.acquire()
  assert len(warnings) == 1 and "its holder is gone" in warnings[0], warnings
  assert lock.held()
  with pytest.raises(lock_lib.RunDirBusy) as e:   # the same process cannot take it twice
    lock_lib.RunDirLock(str(tmp_path)).acquire()
  assert "already held by this process" in str(e.value)
  lock.release()
  assert not os.path.exists(tmp_path / lock_lib.LOCK_NAME)


def test_another_hosts_lock_is_respected_unless_forced(tmp_path):
  _write_lock(tmp_path, "gpu-node-7", 4242)
  with pytest.raises(lock_lib.RunDirBusy) as e:
    lock_lib.RunDirLock(str(tmp_path)).acquire()
  msg = str(e.value)
  assert "\n" not in msg and "pid 4242 on host gpu-node-7" in msg, msg
  assert "train.force_unlock = True" in msg and lock_lib.LOCK_NAME in msg, msg
  forced = lock_lib.RunDirLock(str(tmp_path), force=True)
  assert "forced (train.force_unlock)" in forced.acquire()[0]
  assert forced.held()
  _write_lock(tmp_path, "gpu-node-7", 4242)   # taken back behind our back: no longer ours
  assert not forced.held()
  forced.release()                             # and then it is not ours to remove
  assert os.path.exists(tmp_path / lock_lib.LOCK_NAME)


# --- the two-run experiment ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_run_on_a_live_run_dir_stops_at_once_and_touches_nothing(
    tmp_path, reference_losses):  # noqa: F811
  """The everyday mistake: the same command again while the first run still runs. The first
  run is held (SIGSTOP) after a checkpoint, so the second surely meets a live one; then it
  goes on, and is stopped (SIGTERM: it saves and exits) to keep the test short."""
  run_dir = tmp_path / "run"
  command = run_helpers.train_command(run_dir)
  first = run_helpers.start(command, tmp_path / "first.log")
  try:
    run_helpers.wait_for_step(first, run_dir, 12, tmp_path / "first.log")
    first.send_signal(signal.SIGSTOP)
    time.sleep(0.5)   # let an async checkpoint write settle (the process is stopped anyway)
    before = _files(run_dir)
    tick = time.perf_counter()
    # JAX logs every compilation it makes: none may appear (the error line must be alone).
    second = subprocess.run(command, cwd=run_helpers.REPO_ROOT,
                            env=dict(run_helpers.subprocess_env(), JAX_LOG_COMPILES="1"),
                            capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - tick
    assert second.returncode == 2, second.stderr[-2000:]
    errors = our_stderr_lines(second.stderr)   # without XLA's start-up log (CUDA plugin installed)
    assert len(errors) == 1 and errors[0].startswith("error: train.run_dir="), second.stderr
    assert f"in use by pid {first.pid} on host {socket.gethostname()}" in errors[0], errors[0]
    assert "wait for that run to end or stop it, or use another train.run_dir" in errors[0]
    assert "steps " not in second.stdout   # it trained nothing
    # Python's and JAX's start-up only: ~5 s on a quiet 2-core VM, 71 s when 4 jobs shared it.
    assert seconds < 300, seconds
    assert _files(run_dir) == before        # not one byte of the first run changed
  finally:
    first.send_signal(signal.SIGCONT)
    first.send_signal(signal.SIGTERM)
  assert first.wait(timeout=240) == 0, (tmp_path / "first.log").read_text()[-3000:]
  records = read_jsonl(run_dir / "metrics.jsonl")
  steps = [r["step"] for r in records if "loss" in r]
  assert steps == list(range(len(steps))) and len(steps) > 12   # each step once, none lost
  losses = step_losses(records)
  assert losses == {s: reference_losses[s] for s in steps}
  assert checkpoint_steps(run_dir)[-1] == len(steps)          # its own save at the SIGTERM
  assert not os.path.exists(run_dir / lock_lib.LOCK_NAME)     # released at the end


# --- a checkpoint of another model --------------------------------------------------------------

@pytest.mark.parametrize("binding,field,theirs,ours", [
    ("model.d_model = 64", "model.d_model", 32, 64),
    ("model.num_layers = 4", "model.num_layers", 2, 4),
    ("moe.num_experts = 16", "moe.num_experts", 8, 16),
    ("model.vocab_size = 512", "model.vocab_size", 256, 512),
])
@pytest.mark.slow   # with the fresh venv's install, over the 8-minute budget
def test_a_checkpoint_of_another_model_stops_with_one_line(tmp_path, monkeypatch, capsys,
                                                          binding, field, theirs, ours,
                                                          reference_losses):  # noqa: F811
  monkeypatch.syspath_prepend(run_helpers.REPO_ROOT)
  import train as train_cli

  run_dir = tmp_path / "run"
  shutil.copytree(run_helpers.shared_dir("reference_run"), run_dir)
  before = _files(run_dir)
  rc = train_cli.main(run_helpers.bindings(run_dir) + [f"--gin_bindings={binding}"])
  err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert rc == 2 and len(err) == 1, err
  assert err[0].startswith(f"error: checkpoint {run_dir}/checkpoints/30 holds another model: "
                           f"{field}={theirs} there, {field}={ours} in this config; "
                           f"set {field} = {theirs} to resume it"), err[0]
  assert _files(run_dir) == before   # its config files and metrics are the first run's still


# --- a full disk, and the torn line it leaves ---------------------------------------------------

def _no_space(path: str) -> OSError:
  return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_and_it_resumes_once_space_is_freed(
    tmp_path, monkeypatch, capsys, reference_losses):  # noqa: F811
  """Injected at the write boundaries (orbax's save of step 20; then, in the second attempt,
  the metrics line of step 12, half written): each stops the run with one line naming the path
  and the room needed; the third attempt, with space again, ends exactly like the reference.
  The run dir starts as the reference run's at its checkpoint 10, to keep the test short."""
  monkeypatch.syspath_prepend(run_helpers.REPO_ROOT)
  import train as train_cli

  run_dir = tmp_path / "run"
  shutil.copytree(run_helpers.shared_dir("reference_run"), run_dir)
  for step in (20, 30):
    shutil.rmtree(run_dir / "checkpoints" / str(step))
  kept = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
          if json.loads(line)["step"] < 10]
  (run_dir / "metrics.jsonl").write_text("".join(kept))
  trace = tmp_path / "trace.npz"
  flags = run_helpers.bindings(run_dir) + [f"--gin_bindings=trace.path = '{trace}'"]
  clean_save = ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    if step == 20:
      raise _no_space(f"{run_dir}/checkpoints/20.orbax-checkpoint-tmp")
    return clean_save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  assert train_cli.main(flags) == 4
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  assert err[0].startswith(f"error: could not write checkpoint step 20 to {run_dir}/checkpoints: "
                           "No space left on device ("), err[0]
  assert "MiB free there, it needs about " in err[0] and "MiB); nothing saved before" in err[0]
  assert err[0].endswith(f"resume from step 10 in {run_dir}/checkpoints."), err[0]
  assert checkpoint_steps(run_dir) == [10]
  monkeypatch.setattr(ocp.CheckpointManager, "save", clean_save)

  clean_open = open

  class HalfFull:   # the disk fills in the middle of step 12's line
    def __init__(self, f):
      self.f = f

    def write(self, text):
      if json.loads(text)["step"] == 12:
        self.f.write(text[:len(text) // 2])
        self.f.flush()
        raise _no_space(str(run_dir / "metrics.jsonl"))
      return self.f.write(text)

    def close(self):
      self.f.close()

  def open_metrics(path, mode="r", *args, **kwargs):
    f = clean_open(path, mode, *args, **kwargs)
    return HalfFull(f) if mode == "a" else f

  monkeypatch.setattr(metrics_lib, "open", open_metrics, raising=False)
  assert train_cli.main(flags) == 4
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      f"error: could not write the metrics of step 12 to {run_dir}/metrics.jsonl: No space "
      "left on device"), err
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  assert lines[-1].startswith('{"step": 12') and not lines[-1].endswith("}")   # torn
  monkeypatch.undo()

  monkeypatch.syspath_prepend(run_helpers.REPO_ROOT)
  assert train_cli.main(flags) == 0
  out = capsys.readouterr().out
  assert f"steps 10..{run_helpers.STEPS - 1}: loss" in out, out
  records = read_jsonl(run_dir / "metrics.jsonl")   # every line whole, every step once
  assert [r["step"] for r in records if "loss" in r] == list(range(run_helpers.STEPS))
  assert step_losses(records) == reference_losses
  assert checkpoint_steps(run_dir) == [20, 30]
  with np.load(trace) as t:   # recorded from the first resume on, each step once
    assert t["step"].tolist() == list(range(10, run_helpers.STEPS))


# --- history is kept: a fresh start over an earlier run, a resume that changes training -------

def _train_main(monkeypatch):
  monkeypatch.syspath_prepend(run_helpers.REPO_ROOT)
  import train as train_cli

  return train_cli.main


def _earlier_metrics(run_dir, steps: int = 35) -> None:
  os.makedirs(run_dir, exist_ok=True)
  with open(run_dir / "metrics.jsonl", "w") as f:
    for step in range(steps):
      f.write(json.dumps({"step": step, "loss": 6.0 - step / 100}) + "\n")


@pytest.mark.parametrize("earlier", ["metrics", "damaged"])
def test_a_fresh_start_over_an_earlier_run_is_refused_and_touches_nothing(
    tmp_path, monkeypatch, capsys, earlier):
  """All checkpoints lost (damaged ones moved aside, or deleted): the same command again would
  start at step 0 and rewrite the run's record; it stops before any work instead."""
  run_dir = tmp_path / "run"
  _earlier_metrics(run_dir)
  if earlier == "damaged":
    (run_dir / "checkpoints_damaged" / "30").mkdir(parents=True)
    (run_dir / "checkpoints_damaged" / "30" / "x").write_text("rot")
    (run_dir / "metrics.jsonl").write_text("")
  before = _files(run_dir)
  rc = _train_main(monkeypatch)(run_helpers.bindings(run_dir))
  err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert rc == 2 and len(err) == 1, err
  assert err[0].startswith(f"error: train.run_dir='{run_dir}' holds an earlier run ("), err[0]
  assert "metrics.jsonl up to step 34" in err[0] or "damaged checkpoints in" in err[0], err[0]
  assert "set train.restart = True to move its files into" in err[0], err[0]
  assert _files(run_dir) == before and sorted(os.listdir(run_dir)) == sorted(
      ["metrics.jsonl"] + (["checkpoints_damaged"] if earlier == "damaged" else []))


def test_a_run_stopped_before_its_first_checkpoint_starts_over_without_asking(tmp_path):
  """Metrics up to the second checkpoint (a kill while the first save was still being written)
  are not a history to keep: those steps are redone, as the chaos runs expect."""
  from moejax.train import history

  _earlier_metrics(tmp_path, steps=20)
  assert history.earlier_run(str(tmp_path), every=10) is None
  _earlier_metrics(tmp_path, steps=21)
  assert history.earlier_run(str(tmp_path), every=10) == "metrics.jsonl up to step 20"


def test_a_rerun_with_no_checkpoint_yet_says_so(tmp_path, monkeypatch, caplog):
  """A 30-step run killed at step 24 with checkpoint.every = 100 saved nothing: its rerun
  starts at step 0 and says why, before anything compiles (the build is left out here)."""
  from moejax.train.trainer import Trainer
  from tests.run_config import tiny_config

  run_dir = tmp_path / "run"
  monkeypatch.setattr(Trainer, "_build", lambda self, *args: None)
  with caplog.at_level("INFO", logger="moejax"):
    Trainer(tiny_config(run_dir, num_steps=30, every=100)).close()
  assert not [r for r in caplog.records if "no checkpoint" in r.getMessage()]   # a first start
  _earlier_metrics(run_dir, steps=25)
  caplog.clear()
  with caplog.at_level("INFO", logger="moejax"):
    Trainer(tiny_config(run_dir, num_steps=30, every=100)).close()
  said = [r.getMessage() for r in caplog.records if "no checkpoint" in r.getMessage()]
  assert said == [f"starting at step 0: no checkpoint in {run_dir / 'checkpoints'} yet (an "
                  "earlier start reached step 24; the first save is at step 100, "
                  "checkpoint.every), so its steps are redone"], caplog.records


def test_metrics_of_redone_steps_are_kept_aside(tmp_path):
  """A resume from step 3 redoes steps 3 and 4: their old records move to
  metrics.redone.jsonl, the ones before stay, the torn last line goes."""
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(5)]
  path.write_text("".join(lines) + '{"step": 5, "lo')
  writer = metrics_lib.JsonlWriter(str(path), start=3)
  writer.write({"step": 3, "loss": -1.0})
  writer.close()
  assert path.read_text() == "".join(lines[:3]) + json.dumps({"step": 3, "loss": -1.0}) + "\n"
  assert (tmp_path / "metrics.redone.jsonl").read_text() == "".join(lines[3:])


@pytest.mark.slow   # two tiny runs and a third that compiles nothing: ~40 s on the 2-core VM
def test_restart_keeps_the_earlier_run_and_a_resume_says_what_it_changes(
    tmp_path, monkeypatch, capsys, caplog):
  main = _train_main(monkeypatch)
  caplog.set_level("INFO", logger="moejax")

  def logged() -> list[str]:   # the trainer's lines (train.py prints them as they are)
    lines = [r.getMessage() for r in caplog.records if r.name == "moejax"]
    caplog.clear()
    return lines

  run_dir = tmp_path / "run"
  _earlier_metrics(run_dir)
  flags = run_helpers.bindings(run_dir, num_steps=4, every=2)
  assert main(flags + ["--gin_bindings=train.restart = True"]) == 0
  err = logged()
  assert any("moved the earlier run's files" in line and "previous.1" in line
             for line in err), err
  assert len(read_jsonl(run_dir / "previous.1" / "metrics.jsonl")) == 35   # kept, whole
  assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r] == [0, 1, 2, 3]
  first = json.loads((run_dir / "config.0.json").read_text())
  assert first["optim"]["decay_steps"] == 4   # train.num_steps of the first start, saved

  # Extended with another batch and top_k: one warning line each, the saved schedule goes on.
  more = [f"--gin_bindings={b}" for b in ("train.num_steps = 6", "data.global_batch_size = 16",
                                          "moe.top_k = 1")]
  assert main(flags + more) == 0
  err = logged()
  assert f"resuming from step 4 of {run_dir}/checkpoints" in err, err
  for field, now, then in (("data.global_batch_size", 16, 8), ("moe.top_k", 1, 2)):
    assert sum(line.startswith(f"warning: {field}={now} in this config, {then} in checkpoint ")
               for line in err) == 1, err
  assert any("continues as saved: optim.decay_steps=4 (train.num_steps=6)" in line
             for line in err), err
  records = read_jsonl(run_dir / "metrics.jsonl")
  assert [r["step"] for r in records if "loss" in r] == list(range(6))
  assert sum(r.get("event") == "checkpoint_warning" for r in records) == 3
  later = json.loads((run_dir / "config.4.json").read_text())
  assert later["data"]["global_batch_size"] == 16 and later["optim"]["decay_steps"] == 4
  assert json.loads((run_dir / "config.0.json").read_text()) == first   # the first, kept
  lr = {r["step"]: r["lr"] for r in records if "lr" in r}
  schedule = optim.schedule(dataclasses.replace(OptimConfig(warmup_steps=30), decay_steps=4), 4)
  np.testing.assert_allclose([lr[s] for s in range(6)], [schedule(s) for s in range(6)],
                             rtol=1e-6)

  # Nothing to do: said at once, nothing compiled, no config file of a start that did not run.
  names = sorted(os.listdir(run_dir))
  assert main(flags + more) == 0
  assert "nothing to do" in capsys.readouterr().out
  assert sorted(os.listdir(run_dir)) == names


def _meta_only_checkpoint(run_dir, step: int, model: dict) -> str:
  """A checkpoint step holding only what the start-up checks read (its meta), as orbax
  writes it; returns the step's directory."""
  mngr = ocp.CheckpointManager(
      str(run_dir / "checkpoints"), options=ocp.CheckpointManagerOptions(create=True),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"x": np.zeros(2)}),
                                          meta=ocp.args.JsonSave({"model": model})))
  mngr.close()
  return str(run_dir / "checkpoints" / str(step))


def test_another_vocabulary_in_the_run_dir_advises_a_new_run_dir(tmp_path, monkeypatch, capsys,
                                                                caplog):
  """The default job's run dir, then the user's own prepared text: the model's vocabulary
  follows the data, so "set model.vocab_size = ..." cannot help; the line says so. The
  step's `_CHECKPOINT_METADATA` is torn too: orbax's parse error is recovered from (the meta
  reads) and not shown."""
  from moejax.prepare_data import prepare
  from moejax.train.checkpoint import model_fields
  from tests.run_config import tiny_config

  (tmp_path / "text.txt").write_text("some text of the user's own\n" * 400)
  prepare(str(tmp_path / "text.txt"), str(tmp_path / "data"), byte_level=True, progress=False)
  run_dir = tmp_path / "run"
  theirs = dict(model_fields(tiny_config(run_dir, 30, 10)), **{"model.vocab_size": 1024})
  step_dir = _meta_only_checkpoint(run_dir, 30, theirs)
  with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "r+") as f:
    f.truncate(7)
  before = _files(run_dir)
  caplog.set_level("INFO")
  rc = _train_main(monkeypatch)(run_helpers.bindings(run_dir) +
                                [f"--gin_bindings=data.path = '{tmp_path / 'data'}'"])
  err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert rc == 2 and len(err) == 1, err
  assert "model.vocab_size=1024 there, model.vocab_size=256 in this config" in err[0], err[0]
  assert "set train.run_dir to a new directory" in err[0], err[0]
  assert "set model.vocab_size = 1024" not in err[0], err[0]
  assert not [r for r in caplog.records if "Failed to json parse" in r.getMessage()]
  assert _files(run_dir) == before


def test_the_saved_horizon_holds_and_each_changed_training_field_is_one_line(tmp_path):
  """Host only: what a resume decides from the checkpoint's record (the end-to-end run above
  is in the slow tier)."""
  from moejax.train import history
  from tests.run_config import tiny_config

  first = tiny_config(tmp_path, num_steps=30, every=10)
  assert history.decay_steps(first, None) == (30, None)   # a fresh run: train.num_steps
  saved = {"training": history.training_fields(
      dataclasses.replace(first, optim=dataclasses.replace(first.optim, decay_steps=30)))}
  longer = dataclasses.replace(first, train=dataclasses.replace(first.train, num_steps=34))
  steps, note = history.decay_steps(longer, saved)
  assert steps == 30 and "continues as saved: optim.decay_steps=30 (train.num_steps=34)" in note
  assert history.decay_steps(longer, {}) == (34, None)    # a checkpoint without the record
  chosen = dataclasses.replace(longer, optim=dataclasses.replace(longer.optim, decay_steps=34))
  assert history.decay_steps(chosen, saved) == (34, None)
  changed = dataclasses.replace(chosen, data=dataclasses.replace(chosen.data, seq_len=16))
  lines = history.training_changes(saved, changed, "checkpoint C/30", 30)
  assert lines == [
      "data.seq_len=16 in this config, 32 in checkpoint C/30; steps from 30 on use 16 "
      "(config.30.json in the run dir records it)",
      "optim.decay_steps=34 in this config, 30 in checkpoint C/30; steps from 30 on use 34 "
      "(config.30.json in the run dir records it)"]
