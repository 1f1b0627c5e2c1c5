"""Two processes x 4 CPU devices over loopback (gloo) train like one process x 8 devices,
stop together on SIGTERM with one collective checkpoint, and that checkpoint resumes on one
process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests import run_helpers
from tests.run_helpers import (  # noqa: F401  (fixtures)
  compile_cache,
  reference_losses,
)
from tests.test_train import checkpoint_steps, read_jsonl, step_losses, tiny_config

pytestmark = pytest.mark.usefixtures("compile_cache")


def test_two_processes_match_one_stop_together_and_resume(tmp_path, reference_losses):  # noqa: F811
  run_dir = tmp_path / "run"
  log = tmp_path / "launch.log"
  launcher = [sys.executable, "-m", "moejax.launch", "--processes", "2",
              "--devices_per_process", "4", "--", *run_helpers.train_command(run_dir)]
  proc = run_helpers.start(launcher, log)
  run_helpers.wait_for_step(proc, run_dir, 3, log)
  proc.send_signal(signal.SIGTERM)            # forwarded to both processes
  try:
    assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  out = log.read_text()
  reached = max(run_helpers.logged_steps(run_dir)) + 1
  assert 3 < reached < run_helpers.STEPS
  assert f"[0] stopped by SIGTERM: saved step {reached} in" in out, out[-3000:]
  assert "[1] stopped" not in out               # only process 0 reports
  assert checkpoint_steps(run_dir) == [s for s in (10, 20) if s < reached][-1:] + [reached]
  assert "[0] steps" not in out and "Traceback" not in out, out[-3000:]

  losses = step_losses(read_jsonl(run_dir / "metrics.jsonl"))
  assert sorted(losses) == list(range(reached))
  # Same data and math; the cross-process all-reduces add in another order (float32 ulps).
  np.testing.assert_allclose([losses[s] for s in range(reached)],
                             [reference_losses[s] for s in range(reached)], rtol=1e-5)

  # The collective checkpoint restores on one process with 8 devices and the run goes on.
  summary = run_helpers.run_in_process(
      tiny_config(run_dir, num_steps=run_helpers.STEPS, every=run_helpers.EVERY))
  assert summary["start_step"] == reached
  losses = step_losses(read_jsonl(run_dir / "metrics.jsonl"))
  assert sorted(losses) == list(range(run_helpers.STEPS))
  np.testing.assert_allclose([losses[s] for s in range(run_helpers.STEPS)],
                             [reference_losses[s] for s in range(run_helpers.STEPS)], rtol=1e-4)
  assert os.path.exists(run_dir / "operative_config.gin")
