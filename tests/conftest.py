"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere; on a GPU host the
GPU too, so its compiled-kernel tests run without being asked for."""

import os

from moejax.runtime import xla_flags  # stdlib only: safe before jax starts


def default_platforms(plugins, device_nodes) -> str:
  """JAX_PLATFORMS when the user set none: CPU first (the default device, the 8 fake devices
  every test expects), then the GPU platform where its plugin is installed and its driver's
  device node exists (a plugin without a GPU would make JAX fail at start-up)."""
  for tag, node in (("cuda", "/dev/nvidiactl"), ("rocm", "/dev/kfd")):
    if any(tag in name.lower() for name in plugins) and node in device_nodes:
      return f"cpu,{tag}"
  return "cpu"


# LLVM's optimisation level 0 for the CPU programs: the tests compile some hundreds of small
# programs that run for milliseconds, so compile time is what they spend (docs/decisions/0059).
# The level applies only to machine-code generation, after XLA's HLO passes and scheduling,
# which is what the tests that read the compiled program inspect. A user's own XLA_FLAGS come
# after it, so theirs win.
os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 " +
                           os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
if "JAX_PLATFORMS" not in os.environ:
  os.environ["JAX_PLATFORMS"] = default_platforms(
      xla_flags.installed_jax_plugins(),
      {n for n in ("/dev/nvidiactl", "/dev/kfd") if os.path.exists(n)})

import jax  # noqa: F401  (imported after XLA_FLAGS on purpose)
import pytest


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert len(jax.devices()) == 8, "tests need 8 fake CPU devices; is jax imported before conftest?"


@pytest.fixture(autouse=True, scope="session")
def _session_compile_cache():
  """One persistent compilation cache for the whole session (and the processes tests start):
  many tests build the same small programs. Compile-count tests stay strict: CompileCounter
  counts executables loaded from this cache as compilations, and `_cache_size` counts traces."""
  from tests.run_helpers import cache_on, shared_dir

  with cache_on(shared_dir("jax_cache")) as directory:
    yield directory


@pytest.fixture
def emulated_collective(monkeypatch):
  """The ragged path on CPU: jax.lax.ragged_all_to_all replaced by its all_to_all emulation."""
  from moejax.model.moe import ragged

  monkeypatch.setattr(ragged, "ragged_all_to_all", ragged.emulated_ragged_all_to_all)
  monkeypatch.setattr(ragged, "check_platform", lambda platform: None)
