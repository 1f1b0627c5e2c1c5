"""Benchmarks, each run from the repository root as `python -m benchmarks.NAME --help`.

Importing this package fakes 8 host CPU devices before any benchmark imports jax (unless the
caller set XLA_FLAGS), so every benchmark sees the mesh the tests use. On a GPU machine the
flag only affects the host platform.
"""

import os

if "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
