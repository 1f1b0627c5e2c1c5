"""Multi-process start-up with JAX's own runtime (`jax.distributed`), and small agreements.

`maybe_initialize()` runs before any device is touched. It starts `jax.distributed` when the
environment describes more than one process:

- explicitly: `JAX_COORDINATOR_ADDRESS=host:port`, `JAX_NUM_PROCESSES=P`, `JAX_PROCESS_ID=i`
  (JAX itself reads the address; the count and id are passed on by us);
- or a cluster JAX detects on its own: SLURM (`srun`, `SLURM_NTASKS` > 1) or Open MPI
  (`mpirun`, `OMPI_COMM_WORLD_SIZE` > 1); `MOEJAX_DISTRIBUTED=1` forces detection for the
  other clusters JAX knows, `MOEJAX_DISTRIBUTED=0` turns all of this off.

On CPU, cross-process collectives go through gloo, so the same path runs on one machine; the
lines Gloo prints to stdout for every communicator that reached all its peers are left out
(`moejax.runtime.streams`), as the launcher leaves them out.
"""

from __future__ import annotations

import os

import numpy as np

from moejax.config import ConfigError

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
ENV_SWITCH = "MOEJAX_DISTRIBUTED"
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")


def _int_env(name: str, env) -> int:
  value = env[name]
  try:
    return int(value)
  except ValueError:
    raise ConfigError(f"{name}={value!r} is not an integer; set e.g. {name}=0.") from None


def _cluster(env) -> str | None:
  """The multi-task cluster JAX will auto-detect (its own environment variables), if any."""
  if all(v in env for v in _SLURM_VARS) and _int_env("SLURM_NTASKS", env) > 1:
    return "SLURM"
  if "OMPI_MCA_orte_hnp_uri" in env and _int_env("OMPI_COMM_WORLD_SIZE", env) > 1:
    return "Open MPI"
  return None


def initialize_kwargs(env=None) -> dict | None:
  """kwargs for `jax.distributed.initialize`, or None for a single-process run."""
  env = os.environ if env is None else env
  switch = env.get(ENV_SWITCH, "")
  if switch not in ("", "0", "1"):
    raise ConfigError(f"{ENV_SWITCH}={switch!r} must be 0 (off), 1 (let JAX detect the "
                      "cluster) or unset.")
  if switch == "0":
    return None
  names = (ENV_ADDRESS, ENV_COUNT, ENV_ID)
  given = [n for n in names if n in env]
  if len(given) == len(names):
    address, count, pid = env[ENV_ADDRESS], _int_env(ENV_COUNT, env), _int_env(ENV_ID, env)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      raise ConfigError(f"{ENV_ADDRESS}={address!r} must be host:port, e.g. 10.0.0.1:1234.")
    if count < 1 or not 0 <= pid < count:
      raise ConfigError(f"{ENV_ID}={pid} must be in [0, {ENV_COUNT}={count}); number the "
                        "processes 0..P-1.")
    if count == 1:
      return None
    return {"coordinator_address": address, "num_processes": count, "process_id": pid}
  if switch == "1" or _cluster(env) is not None:
    return {}   # JAX reads its cluster's environment (SLURM, Open MPI, ...)
  if given:
    missing = [n for n in names if n not in env]
    raise ConfigError(f"{', '.join(given)} set but {', '.join(missing)} not; set all of "
                      f"{ENV_ADDRESS}=host:port {ENV_COUNT}=P {ENV_ID}=i on every process.")
  return None


def maybe_initialize(env=None) -> bool:
  """Starts `jax.distributed` when the environment asks for it; True if it did."""
  kwargs = initialize_kwargs(env)
  if kwargs is None:
    return False
  import jax

  if jax.distributed.is_initialized():
    return True
  from moejax.runtime import streams, xla_flags

  if xla_flags.platform_before_init(os.environ, xla_flags.installed_jax_plugins()) == "cpu":
    streams.filter_own_stdout()   # Gloo's "connected" lines, as the launcher leaves them out
  # Harmless off CPU; on CPU it makes cross-process collectives work at all.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(**kwargs)
  except (RuntimeError, ValueError, TypeError) as e:   # unreachable coordinator, bad env, ...
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    where = kwargs.get("coordinator_address") or "the cluster's coordinator"
    raise ConfigError(f"jax.distributed.initialize failed for {where}: {first}; start every "
                      "process with the same coordinator address and process count.") from None
  return True


def all_true(flag: bool) -> bool:
  """True iff `flag` is true on every process (a collective in multi-process runs)."""
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.all(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def barrier(name: str) -> None:
  """Every process waits here until all have arrived (no-op in single-process runs)."""
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
