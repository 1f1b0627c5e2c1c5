"""The GPU defaults: configs/gpt_moe_gpu.gin runs the ragged (load-proportional) path with the
Pallas kernels, and train.py sets XLA's latency-hiding scheduler on GPU unless the user set
XLA_FLAGS (on CPU it fakes the host devices, as before).

The GPU config's whole train step (a tiny model, the config's dispatch, kernels, dtype and
remat) is lowered for CUDA on this CPU host and its collectives are read from the StableHLO.
The layer picks its kernels and checks ragged support from its mesh's platform, and the
8-device test mesh is CPU, so the test makes the layer build its GPU variant (Triton kernels,
the real ragged_all_to_all). Lowering only: compiling needs a CUDA backend, so the
data-parallel gradient reduction of the dense trunk, which Shardy inserts when the program
is partitioned at compile time, is not in this text; the reductions written inside the MoE
layer's shard_map are.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
from benchmarks.common import ir_operations
from moejax.frontend import parse_config
from moejax.model.moe import layer as layer_lib, ragged
from moejax.model.moe.ops import ops_for
from moejax.runtime import xla_flags
from moejax.strategy.spec import from_config
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import build_program
from pallas_kernels import compat

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
GPU_GIN = str(REPO_ROOT / "configs" / "gpt_moe_gpu.gin")
# The config's own choices stay; sizes shrink, and mesh.expert = 4 leaves a data axis of 2
# on the 8 test devices, so the data-parallel reductions of the expert weights show.
TINY = ["model.vocab_size = 256", "model.d_model = 64", "model.num_layers = 4",
        "model.num_heads = 2", "model.d_ff = 128", "model.max_seq_len = 32",
        "moe.num_experts = 16", "moe.d_ff = 64", "mesh.expert = 4", "data.seq_len = 32",
        "data.global_batch_size = 16"]
LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"


# --- the config ---------------------------------------------------------------------------

def test_gpu_config_runs_the_ragged_path_with_pallas_kernels():
  cfg = parse_config([GPU_GIN], [])
  assert (cfg.moe.dispatch, cfg.moe.kernels) == ("ragged", "pallas")
  assert cfg.mesh.host_device_count == 1     # a GPU host fakes no CPU devices
  dtype = cfg.model.dtype
  # The grouped matmul: Mosaic GPU on Hopper (bf16 model), Triton elsewhere; gin overrides.
  assert ops_for(cfg.moe.kernels, "gpu", "9.0", dtype).backend == "mosaic_gpu"
  assert ops_for(cfg.moe.kernels, "gpu", "8.9", dtype).backend == "triton"
  assert ops_for(cfg.moe.kernels, "gpu", None, dtype).backend == "triton"
  cfg = parse_config([GPU_GIN], ["moe.pallas_backend = 'triton'"])
  assert ops_for(cfg.moe.kernels, "gpu", "9.0", dtype, cfg.moe.pallas_backend).backend == "triton"


# --- XLA_FLAGS ------------------------------------------------------------------------------

@pytest.mark.parametrize("env,plugins,platform", [
    ({}, [], "cpu"),
    ({}, ["xla_cuda12"], "gpu"),
    ({}, ["xla_rocm7"], "gpu"),
    ({"JAX_PLATFORMS": "cpu"}, ["xla_cuda12"], "cpu"),
    ({"JAX_PLATFORMS": "cuda"}, [], "gpu"),
    ({"JAX_PLATFORMS": "cpu,cuda"}, ["xla_cuda12"], "cpu"),   # the first entry is the default
    ({"JAX_PLATFORMS": "cuda,cpu"}, [], "gpu"),
    ({"JAX_PLATFORMS": "tpu"}, [], "tpu"),
])
def test_platform_before_init(env, plugins, platform):
  assert xla_flags.platform_before_init(env, plugins) == platform


@pytest.mark.parametrize("env,platform,count,flags", [
    # CPU: exactly what train.py always set (the default job's flags and losses unchanged).
    ({}, "cpu", 8, "--xla_force_host_platform_device_count=8"),
    ({}, "cpu", 1, None),
    ({}, "gpu", 1, " ".join(xla_flags.GPU_FLAGS)),
    ({}, "gpu", 2, "--xla_force_host_platform_device_count=2 " + " ".join(xla_flags.GPU_FLAGS)),
    ({}, "tpu", 1, None),
    # The user's XLA_FLAGS, even empty, replaces every default.
    ({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}, "gpu", 1, None),
    ({"XLA_FLAGS": ""}, "cpu", 8, None),
])
def test_default_xla_flags(env, platform, count, flags):
  assert xla_flags.default_xla_flags(env, platform, count) == flags


@pytest.mark.parametrize("plugins,nodes,want", [
    ([], set(), "cpu"),
    (["xla_cuda12"], set(), "cpu"),                    # a plugin but no GPU: JAX would fail
    (["xla_cuda12"], {"/dev/nvidiactl"}, "cpu,cuda"),  # CPU stays the default (8 devices)
    (["xla_rocm7"], {"/dev/kfd"}, "cpu,rocm"),
])
def test_the_tests_add_the_gpu_platform_when_there_is_one(plugins, nodes, want):
  from tests.conftest import default_platforms
  assert default_platforms(plugins, nodes) == want


def test_gpu_flags_turn_on_the_latency_hiding_scheduler():
  assert LHS in xla_flags.GPU_FLAGS


def test_train_sets_and_prints_the_gpu_flags(monkeypatch, capsys):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  train.set_xla_flags(1)
  assert os.environ["XLA_FLAGS"] == " ".join(xla_flags.GPU_FLAGS)
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == str(xla_flags.GPU_MEMORY_FRACTION)
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 2 and LHS in out[0] and "gpu" in out[0], out
  assert out[1].startswith("XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 "), out


def test_train_leaves_the_users_xla_flags(monkeypatch, capsys):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  train.set_xla_flags(8)
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"
  assert capsys.readouterr().out == ""


@pytest.mark.parametrize("env,platform,want", [
    ({}, "gpu", "0.9"), ({}, "cpu", None), ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, "gpu", None)])
def test_default_memory_fraction(env, platform, want):
  assert xla_flags.default_memory_fraction(env, platform) == want


def test_xla_memory_limit_stays_inside_the_allocators_pool():
  """XLA keeps a program under (80% of device memory less its inputs and outputs) x the slop
  factor / 100: at most 0.8 x factor of the GPU, which must fit the allocator's share."""
  slop = [int(f.split("=")[1]) for f in xla_flags.GPU_FLAGS
          if f.startswith("--xla_gpu_memory_limit_slop_factor=")]
  assert len(slop) == 1 and 0.8 * slop[0] / 100 < xla_flags.GPU_MEMORY_FRACTION


def _start_jax(flags: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, text=True, timeout=120)


def test_installed_xla_knows_the_gpu_flags():
  """XLA parses every flag at start-up on any platform and aborts on an unknown name (the
  control), so a CPU host checks the names against the installed jaxlib."""
  bad = _start_jax("--xla_gpu_enable_no_such_flag=true")
  assert bad.returncode != 0 and "Unknown flag" in bad.stderr, bad.stderr[-2000:]
  ok = _start_jax(" ".join(xla_flags.GPU_FLAGS))
  assert ok.returncode == 0, ok.stderr[-2000:]


# --- the train step lowered for CUDA ------------------------------------------------------

@functools.cache
def _cuda_lowering_error() -> str | None:
  try:
    jax.jit(lambda x: x + 1).trace(jnp.zeros(2)).lower(lowering_platforms=("cuda",))
  except Exception as e:   # noqa: BLE001  (any failure means: no CUDA lowering here)
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  return None


@pytest.fixture
def as_if_gpu(monkeypatch):
  """The MoE layer builds its GPU variant on the CPU test mesh."""
  monkeypatch.setattr(ragged, "check_platform", lambda platform: None)
  monkeypatch.setattr(layer_lib, "ops_for",
                      lambda kernels, platform, *args: ops_for(kernels, "gpu", *args))


def _collectives(module) -> list[tuple[str, str, str]]:
  """(name, replica groups, operand types) of every collective in a StableHLO module;
  ragged_all_to_all is a custom call named by its target."""
  found = []
  for o in ir_operations(module):
    name = o.name
    if name == "stablehlo.custom_call":
      name = str(o.attributes["call_target_name"]).strip('"')
    if name in ("ragged_all_to_all", "stablehlo.all_to_all", "stablehlo.all_reduce",
                "stablehlo.all_gather", "stablehlo.reduce_scatter",
                "stablehlo.collective_permute"):
      key = "replica_groups" if "replica_groups" in o.attributes else "backend_config"
      groups = str(o.attributes[key])
      found.append((name, groups, " ".join(str(v.type) for v in o.operands)))
  return found


def _groups(attr: str, mesh) -> set[frozenset[int]]:
  """Device groups of a collective: a dense list, or mesh axes (the devices that differ only
  along those axes), the two forms the releases in pallas_kernels.compat print."""
  if inner := re.search(r"dense<(\[\[.*?\]\])>", attr):
    return {frozenset(g) for g in json.loads(inner.group(1))}
  axes = re.findall(r'axis_ref<name = "(\w+)"', attr)
  assert "replica_group_mesh_axes" in attr and axes, attr
  ids = np.moveaxis(mesh.device_ids, [mesh.axis_names.index(a) for a in axes],
                    range(-len(axes), 0))
  return {frozenset(g.tolist()) for g in ids.reshape(-1, int(np.prod(ids.shape[-len(axes):])))}


@pytest.mark.slow   # 12-19 s; the kernels' CUDA lowering tests stay in the fast set
def test_gpu_config_train_step_lowers_for_cuda_with_ragged_all_to_all(as_if_gpu):
  if why := _cuda_lowering_error():
    pytest.skip(f"this jaxlib cannot lower for CUDA: {why}")
  cfg = parse_config([GPU_GIN], TINY)
  tx, lr = optimizer(cfg.optim, 10), schedule(cfg.optim, 10)
  prog = build_program(cfg, from_config(cfg, 8), tx, lr, jax.devices(), compile_now=False)
  batch = jax.ShapeDtypeStruct((cfg.data.global_batch_size, cfg.data.seq_len + 1), "int32",
                               sharding=prog.batch_sharding)
  with compat.cuda_target():
    lowered = prog.train_step.trace(prog.abstract_state(tx), batch,
                                    prog.abstract_layout()).lower(lowering_platforms=("cuda",))
  ops = _collectives(lowered.compiler_ir("stablehlo"))
  ids = prog.mesh.device_ids                                     # [data, expert, model]
  expert_groups = {frozenset(ids[i, :, m].tolist()) for i in range(ids.shape[0])
                   for m in range(ids.shape[2])}
  data_groups = {frozenset(ids[:, j, m].tolist()) for j in range(ids.shape[1])
                 for m in range(ids.shape[2])}
  d, e, f = cfg.model.d_model, cfg.moe.num_experts, cfg.moe.d_ff
  slots = e // ids.shape[1]

  # Tokens move by ragged_all_to_all over the expert axis, in the compute dtype: dispatch and
  # return, forward and transposed (the forward twice more under remat).
  moves = [o for o in ops if o[0] == "ragged_all_to_all"]
  assert len(moves) >= 4, ops
  for _, groups, types in moves:
    assert _groups(groups, prog.mesh) == expert_groups and f"x{d}xbf16>" in types, (groups, types)
  # No fixed-capacity exchange: the only dense all_to_alls carry integer offsets.
  a2a = [t for name, _, t in ops if name == "stablehlo.all_to_all"]
  assert all(re.fullmatch(r"(tensor<\d+xi32> ?)+", t) for t in a2a), a2a
  # Gradient all-reduces: each expert weight over the data axis, the router over all devices.
  reduces = [(_groups(g, prog.mesh), t) for name, g, t in ops if name == "stablehlo.all_reduce"]
  weight_grads = [t for g, t in reduces if g == data_groups
                  and t in (f"tensor<{slots}x{d}x{f}xbf16>", f"tensor<{slots}x{f}x{d}xbf16>")]
  assert len(weight_grads) >= 3, reduces
  all_devices = {frozenset(ids.flatten().tolist())}
  assert any(g == all_devices and t == f"tensor<{d}x{e}xf32>" for g, t in reduces), reduces
  # The Pallas kernels are Triton calls.
  assert lowered.as_text().count("__gpu$xla.gpu.triton") > 0


@pytest.mark.slow   # ~20-40 s: a train step lowered; the kernels' own vmap test is in the fast set
def test_microbatched_qwen3_step_lowers_for_cuda_with_mosaic_gpu(monkeypatch):
  """`train.microbatches > 1` on one GPU runs the train step's microbatch loop (stages run the
  pipeline's stage vmap, which Pallas cannot batch for Mosaic GPU: "object of type
  'TransformedRef' has no len()", seen on an H200); on Hopper the grouped matmul is Mosaic
  GPU's. configs/qwen3_moe.gin's choices, tiny, on one device, lowered for CUDA as a Hopper
  GPU's program."""
  if why := _cuda_lowering_error():
    pytest.skip(f"this jaxlib cannot lower for CUDA: {why}")
  monkeypatch.setattr(ragged, "check_platform", lambda platform: None)
  monkeypatch.setattr(layer_lib, "ops_for", lambda kernels, platform, capability, *args:
                      ops_for(kernels, "gpu", "9.0", *args))
  cfg = parse_config([str(REPO_ROOT / "configs" / "qwen3_moe.gin")], [
      "model.vocab_size = 256", "model.d_model = 128", "model.num_layers = 2",
      "model.num_heads = 2", "model.num_kv_heads = 1", "model.head_dim = 64",
      "model.max_seq_len = 32", "moe.num_experts = 8", "moe.d_ff = 128", "data.seq_len = 32",
      "data.global_batch_size = 4", "train.microbatches = 2", "mesh.expert = 1"])
  tx, lr = optimizer(cfg.optim, 10), schedule(cfg.optim, 10)
  prog = build_program(cfg, from_config(cfg, 1), tx, lr, jax.devices()[:1], compile_now=False)
  batch = jax.ShapeDtypeStruct((cfg.data.global_batch_size, cfg.data.seq_len + 1), "int32",
                               sharding=prog.batch_sharding)
  with compat.cuda_target():
    lowered = prog.train_step.trace(prog.abstract_state(tx), batch,
                                    prog.abstract_layout()).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("mosaic_gpu") > 0
