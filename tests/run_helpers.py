"""Shared by the fault-tolerance tests: the tiny run of tests/test_train.py as train.py flags,
subprocess control, and one uninterrupted in-process reference run (computed once)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import pytest

from moejax.train.trainer import Trainer
from tests.run_config import REPO_ROOT, step_losses, tiny_config

STEPS, EVERY = 30, 10   # num_steps <= 31 keeps the LR schedule, so the programs, of tiny runs


def bindings(run_dir, num_steps: int = STEPS, every: int = EVERY) -> list[str]:
  """`tiny_config(run_dir, num_steps, every)` as --gin_bindings flags (over configs/default.gin,
  so the fields where the default job differs from the dataclass defaults are set too)."""
  return [f"--gin_bindings={b}" for b in (
      "mesh.data = 2", "mesh.expert = 4", "mesh.model = 1",
      "model.d_model = 32", "model.num_layers = 2", "model.num_heads = 2", "model.d_ff = 64",
      "model.max_seq_len = 32", "moe.num_experts = 8", "moe.top_k = 2", "moe.d_ff = 32",
      "moe.moe_every = 2", "moe.capacity = 'slot'", "planner.policy = 'static'",
      "data.seq_len = 32", "data.global_batch_size = 8",
      "data.max_corpus_bytes = 200000", "optim.warmup_steps = 30",
      f"checkpoint.every = {every}", "checkpoint.keep = 2",
      f"train.run_dir = '{run_dir}'", f"train.num_steps = {num_steps}",
      "train.eval_every = 100", "train.eval_batches = 2", "train.progress_bar = False")]


def train_command(run_dir, **kw) -> list[str]:
  return [sys.executable, os.path.join(REPO_ROOT, "train.py"), *bindings(run_dir, **kw)]


_CACHE_OPTIONS = {"jax_compilation_cache_dir": None,
                  "jax_persistent_cache_min_compile_time_secs": 0.0,
                  "jax_persistent_cache_min_entry_size_bytes": 0}


_SHARED: dict = {}   # per test process; module globals, as test modules each get own fixtures


def shared_dir(name: str) -> str:
  if name not in _SHARED:
    _SHARED[name] = tempfile.mkdtemp(prefix=f"moejax_{name}_")
    atexit.register(shutil.rmtree, _SHARED[name], True)
  return _SHARED[name]


@contextlib.contextmanager
def cache_on(directory: str):
  """JAX's persistent compilation cache in `directory` (every program, however quick to
  compile) while inside; the previous settings come back after. tests/conftest.py turns it on
  for the session, so the many tiny runs of the tests compile each program once."""
  from jax._src import compilation_cache

  options = dict(_CACHE_OPTIONS, jax_compilation_cache_dir=directory)
  old = {name: getattr(jax.config, name) for name in options}
  for name, value in options.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  try:
    yield directory
  finally:
    for name, value in old.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()


def subprocess_env() -> dict:
  """The test process's own XLA_FLAGS (8 CPU devices) and compilation cache, so that the
  programs are the same (and compiled once)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
  if jax.config.jax_compilation_cache_dir:
    env.update({name.upper(): str(getattr(jax.config, name)) for name in _CACHE_OPTIONS})
  return env


def start(command: list[str], log_path) -> subprocess.Popen:
  log = open(log_path, "w")
  return subprocess.Popen(command, cwd=REPO_ROOT, env=subprocess_env(), stdout=log,
                          stderr=subprocess.STDOUT)


def logged_steps(run_dir) -> list[int]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  steps = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue   # a line being written
      if "loss" in record:
        steps.append(record["step"])
  return steps


def metrics_inode(run_dir) -> int | None:
  path = os.path.join(run_dir, "metrics.jsonl")
  return os.stat(path).st_ino if os.path.exists(path) else None


def wait_for_step(proc: subprocess.Popen, run_dir, step: int, log_path, timeout: float = 240,
                  stale_inode: int | None = None):
  """Blocks until the run has logged a step >= `step` (it must still be running). A resumed run
  rewrites metrics.jsonl (a new inode) first: records in the file `stale_inode` do not count."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    fresh = stale_inode is None or metrics_inode(run_dir) not in (None, stale_inode)
    if fresh and any(s >= step for s in logged_steps(run_dir)):
      return
    if proc.poll() is not None:
      raise AssertionError(f"run ended (rc={proc.returncode}) before step {step}:\n"
                           + open(log_path).read()[-3000:])
    time.sleep(0.02)
  proc.kill()
  raise AssertionError(f"no step {step} within {timeout}s:\n" + open(log_path).read()[-3000:])


def run_in_process(cfg) -> dict:
  with Trainer(cfg) as trainer:
    return trainer.run()


@pytest.fixture
def reference_losses() -> dict[int, float]:
  """Losses of the uninterrupted STEPS-step run on one process with 8 devices (run once; its
  run dir, with checkpoints 10, 20, 30, is shared_dir("reference_run"))."""
  if "reference" not in _SHARED:
    run_dir = shared_dir("reference_run")
    run_in_process(tiny_config(run_dir, num_steps=STEPS, every=EVERY, keep=3))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      _SHARED["reference"] = step_losses([json.loads(line) for line in f])
  assert sorted(_SHARED["reference"]) == list(range(STEPS))
  return dict(_SHARED["reference"])
