"""Faults: SIGKILL and SIGTERM mid-run, SIGINT, non-finite steps, damaged checkpoints.

Each case checks that nothing is lost: the resumed trajectory equals an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from moejax.train import data as data_lib
from moejax.train.checkpoint import CheckpointError
from moejax.train.trainer import Trainer
from tests import run_helpers
from tests.run_config import checkpoint_steps, read_jsonl, step_losses, tiny_config
from tests.run_helpers import reference_losses  # noqa: F401  (fixture)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_sigkill_then_the_same_command_continues_exactly(tmp_path, reference_losses):  # noqa: F811
  """kill -9 at whatever point the run has reached past step 11 (a step, an async checkpoint
  write, ...), then run the same command again: the losses of all steps equal the
  uninterrupted run's bit for bit (same programs, same data order, the whole state restored;
  steps after the checkpoint are recomputed, their old records dropped)."""
  run_dir = tmp_path / "run"
  command = run_helpers.train_command(run_dir)
  log1 = tmp_path / "first.log"
  proc = run_helpers.start(command, log1)
  run_helpers.wait_for_step(proc, run_dir, 11, log1)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait(timeout=60) == -signal.SIGKILL
  killed_at = max(run_helpers.logged_steps(run_dir))
  resumed_from = max([0] + checkpoint_steps(run_dir))   # complete ones only (no tmp dirs)
  assert resumed_from <= killed_at + 1 < run_helpers.STEPS

  log2 = tmp_path / "second.log"
  proc = run_helpers.start(command, log2)
  assert proc.wait(timeout=240) == 0, log2.read_text()[-3000:]
  assert f"steps {resumed_from}..{run_helpers.STEPS - 1}: loss" in log2.read_text()
  records = read_jsonl(run_dir / "metrics.jsonl")
  assert [r["step"] for r in records if "loss" in r] == list(range(run_helpers.STEPS))
  losses = step_losses(records)
  assert [losses[s] for s in range(run_helpers.STEPS)] == [
      reference_losses[s] for s in range(run_helpers.STEPS)]


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_sigint_finishes_the_step_saves_and_returns(tmp_path, monkeypatch):
  cfg = tiny_config(tmp_path, num_steps=8, every=100)
  with Trainer(cfg) as trainer:
    next_local = trainer.loader.next_local

    def interrupt_at_3():
      if trainer.loader.position == 3:
        os.kill(os.getpid(), signal.SIGINT)   # delivered to the handler between bytecodes
      return next_local()

    monkeypatch.setattr(trainer.loader, "next_local", interrupt_at_3)
    before = signal.getsignal(signal.SIGINT)
    summary = trainer.run()
  assert summary["preempted"] == "SIGINT" and summary["saved_step"] == 4
  assert checkpoint_steps(tmp_path) == [4]
  assert signal.getsignal(signal.SIGINT) is before   # handlers restored


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_nonfinite_steps_are_skipped_then_too_many_stop_the_run(tmp_path, monkeypatch, capsys):
  """A corrupt record in the data (a target token id past the vocabulary: its log-probability
  reads as NaN) makes steps 2, 3, 4 non-finite; the compiled step is the normal one."""
  monkeypatch.syspath_prepend(run_helpers.REPO_ROOT)
  import train as train_cli

  bad = {2, 3, 4}
  clean_next_local = data_lib.BatchLoader.next_local

  def next_local(self):
    position = self.position
    rows = clean_next_local(self)
    if position in bad:
      rows = rows.copy()
      rows[0, 5] = 300   # model.vocab_size is 256
    return rows

  monkeypatch.setattr(data_lib.BatchLoader, "next_local", next_local)
  run_dir = tmp_path / "run"
  flags = run_helpers.bindings(run_dir, num_steps=8, every=2) + [
      "--gin_bindings=train.max_consecutive_nonfinite = 3"]
  assert train_cli.main(flags) == 3
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith("error: steps 2..4: 3 consecutive steps had a non-finite loss"), err
  assert f"the last good checkpoint is step 4 in {run_dir}/checkpoints" in err, err
  records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
  assert [r["skipped"] for r in records] == [False, False, True, True, True]
  assert all(np.isnan(r["loss"]) for r in records[2:])
  assert records[4]["nonfinite_consecutive"] == 3 and records[4]["nonfinite_total"] == 3
  assert checkpoint_steps(run_dir) == [2, 4]   # nothing saved after the stop

  # The skipped steps left params and Adam state untouched: checkpoint 4 holds step 2's.
  monkeypatch.setattr(data_lib.BatchLoader, "next_local", clean_next_local)
  cfg = tiny_config(run_dir, num_steps=8, every=2)
  with Trainer(cfg) as trainer:
    at = {s: trainer.checkpointer.restore(trainer.state, trainer.pool.layout, step=s)
          for s in (2, 4)}
    assert int(at[4].state.step) == 4 and int(at[2].state.step) == 2
    assert at[4].meta["nonfinite"] == {"consecutive": 2, "total": 2}
    for a, b in zip(jax.tree.leaves((at[2].state.params, at[2].state.opt_state)),
                    jax.tree.leaves((at[4].state.params, at[4].state.opt_state))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The last good checkpoint resumes (clean data now) and the run finishes.
    summary = trainer.run()
  assert summary["start_step"] == 4 and summary["last"]["step"] == 7
  records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in records] == list(range(8))
  assert all(np.isfinite(r["loss"]) and not r["skipped"] for r in records[4:])


def _data_files(step_dir) -> list[str]:
  """The array data files of a checkpoint step (one OCDBT database per process)."""
  return sorted(glob.glob(os.path.join(step_dir, "state", "ocdbt.process_*", "d", "*")))


def _rot(step_dir) -> None:
  """Bit rot: one byte in every 256 of every data file flipped (tensorstore fails to read)."""
  for path in _data_files(step_dir):
    with open(path, "r+b") as f:
      data = bytearray(f.read())
      data[::256] = bytes(b ^ 0x5A for b in data[::256])
      f.seek(0)
      f.write(data)


def _silently_change_one_array(step_dir) -> None:
  """What silent corruption looks like to the reader: an array whose content no longer matches
  the digest taken at save time. (The data files are compressed, so flipping their bytes
  mostly fails to decode; a flip that decodes to other values looks exactly like this.)"""
  path = os.path.join(step_dir, "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  name = "state/params/layers/moe/w_up"
  meta["digest"][name][0] = (meta["digest"][name][0] + 1) % 2**32
  with open(path, "w") as f:
    json.dump(meta, f)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_damaged_checkpoints_fall_back_to_the_last_intact_one(tmp_path, caplog,
                                                           reference_losses):  # noqa: F811
  run_dir, all_bad = tmp_path / "run", tmp_path / "all_bad"
  for d in (run_dir, all_bad):   # the reference run: checkpoints 10, 20, 30
    shutil.copytree(run_helpers.shared_dir("reference_run"), d)
  assert checkpoint_steps(run_dir) == [10, 20, 30]
  ckpt = run_dir / "checkpoints"
  _silently_change_one_array(ckpt / "30")
  for path in _data_files(ckpt / "20"):                             # a torn copy
    os.truncate(path, os.path.getsize(path) // 2)
  cfg = tiny_config(run_dir, num_steps=run_helpers.STEPS, every=run_helpers.EVERY, keep=3)
  with caplog.at_level("WARNING", logger="moejax"):
    summary = run_helpers.run_in_process(cfg)
  warnings = [r.getMessage() for r in caplog.records if r.name == "moejax"]
  assert len(warnings) == 2, warnings
  assert ("/checkpoints/30 is damaged (content digest differs for 1 arrays, e.g. "
          "state/params/layers/moe/w_up)") in warnings[0], warnings[0]
  assert "/checkpoints/20 is damaged" in warnings[1], warnings[1]
  assert sorted(os.listdir(run_dir / "checkpoints_damaged")) == ["20", "30"]
  # Resumed from 10 and redid steps 10..29 exactly; new checkpoints replace the damaged ones.
  assert summary["start_step"] == 10
  assert step_losses(read_jsonl(run_dir / "metrics.jsonl")) == reference_losses
  assert checkpoint_steps(run_dir) == [10, 20, 30]

  for step in (10, 20, 30):
    _rot(all_bad / "checkpoints" / str(step))
  with Trainer(dataclasses.replace(
      cfg, train=dataclasses.replace(cfg.train, run_dir=str(all_bad)))) as trainer:
    with pytest.raises(CheckpointError) as e:
      trainer.maybe_restore()
  msg = str(e.value)
  assert "\n" not in msg and "no intact checkpoint in" in msg and "tried steps [30, 20, 10]" in msg


def test_digest_sees_one_changed_word_and_ignores_sharding():
  from jax.sharding import NamedSharding, PartitionSpec as P

  from moejax.model.mesh import mesh_of_shape
  from moejax.train import digest

  x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  mesh = mesh_of_shape((2, 4, 1))
  tree = {"a": jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))),
          "b": jax.device_put(np.int32(3), NamedSharding(mesh, P()))}
  expected = digest.tree_digest(tree)
  assert digest.mismatches(
      {"a": jax.device_put(x, NamedSharding(mesh, P(None, "expert"))), "b": tree["b"]},
      expected) == []
  y = x.copy()
  y[40, 3] = np.nextafter(y[40, 3], np.inf)          # one ulp in one element
  z = x.copy()
  z[[1, 2]] = z[[2, 1]]                               # two rows swapped: same plain sum
  for changed in (y, z):
    assert digest.mismatches({"a": jax.device_put(changed), "b": tree["b"]}, expected) == ["a"]
