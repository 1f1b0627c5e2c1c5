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
from tests.run_config import checkpoint_steps, read_jsonl, step_losses, tiny_config
from tests.run_helpers import reference_losses  # noqa: F401  (fixture)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
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


def test_distributed_plan_reads_explicit_env_and_clusters():
  from moejax.config import ConfigError
  from moejax.runtime.distributed import initialize_kwargs

  assert initialize_kwargs({}) is None
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "3"}
  assert initialize_kwargs(env) == {"coordinator_address": "10.0.0.1:1234",
                                    "num_processes": 4, "process_id": 3}
  assert initialize_kwargs(dict(env, JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0")) is None
  assert initialize_kwargs(dict(env, MOEJAX_DISTRIBUTED="0")) is None
  slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
  assert initialize_kwargs(slurm) == {}
  assert initialize_kwargs(dict(slurm, SLURM_NTASKS="1")) is None
  assert initialize_kwargs({"MOEJAX_DISTRIBUTED": "1"}) == {}
  for bad, needle in (({"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_NUM_PROCESSES, JAX_PROCESS_ID"),
                      (dict(env, JAX_PROCESS_ID="4"), "JAX_PROCESS_ID=4 must be in [0, "),
                      (dict(env, JAX_NUM_PROCESSES="two"), "JAX_NUM_PROCESSES='two'"),
                      (dict(env, JAX_COORDINATOR_ADDRESS="10.0.0.1"), "must be host:port"),
                      ({"MOEJAX_DISTRIBUTED": "yes"}, "MOEJAX_DISTRIBUTED='yes'")):
    with pytest.raises(ConfigError) as e:
      initialize_kwargs(bad)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_launcher_env_exit_codes_and_usage(capsys):
  from moejax import launch as launch_cli
  from moejax.runtime import processes

  env = processes.child_env({"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"},
                         1, 2, 4321, devices_per_process=4)
  assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:4321"
  assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"], env["JAX_PLATFORMS"]) == (
      "2", "1", "cpu")
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
  assert processes.exit_code(-9) == 137 and processes.exit_code(3) == 3
  # A failing child fails the launch, and its siblings are not left running.
  code = processes.launch([sys.executable, "-c",
                        "import os, time; pid = int(os.environ['JAX_PROCESS_ID']);"
                        "time.sleep(60) if pid == 0 else exit(5)"], processes=2)
  assert code == 5
  with pytest.raises(SystemExit):
    launch_cli.main(["--processes", "2"])
  assert "give the command after --" in capsys.readouterr().err


def test_each_process_reads_only_the_rows_its_devices_hold():
  from moejax.model.mesh import batch_sharding, mesh_of_shape
  from moejax.train import data as data_lib

  sharding = batch_sharding(mesh_of_shape((2, 4, 1)))
  assert data_lib.process_rows(sharding, 16, 33) == (0, 16)   # one process holds all rows
  tokens = np.arange(10_000, dtype=np.uint16)
  whole = data_lib.BatchLoader(tokens, seq_len=8, global_batch_size=8, seed=0)
  parts = [data_lib.BatchLoader(tokens, seq_len=8, global_batch_size=8, seed=0, rows=r)
           for r in ((0, 2), (2, 8))]
  for position in (0, 5, 500):   # also past an epoch
    np.testing.assert_array_equal(np.concatenate([p.batch_at(position) for p in parts]),
                                  whole.batch_at(position))
