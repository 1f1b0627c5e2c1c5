"""Each Pallas kernel equals its plain-jnp reference, outputs and gradients.

`interpret` runs everywhere (CI: 8 fake CPU devices). `gpu` runs the same cases compiled with
the Triton backend on a GPU and skips without one; on a GPU host run
`JAX_PLATFORMS=cpu,cuda pytest tests/test_pallas_kernels.py` (cpu first keeps the 8 fake CPU
devices the suite expects as the default, cuda adds the GPU). The `lowers_for_cuda` tests
run on CPU: they lower the kernels (forward and backward, inside shard_map with its
varying-axes check on) to Triton / Mosaic GPU IR for CUDA, which catches unsupported ops and
shapes but compiles and runs nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import backend as backend_lib
from pallas_kernels.grouped_matmul import GmmTuning, gmm, gmm_reference, tgmm, tgmm_reference
from pallas_kernels.permute import PermuteTuning, invert, permute, permute_reference
from pallas_kernels.unpermute import (
  CombineTuning,
  unpermute_combine,
  unpermute_combine_reference,
)
from tests import numerics
from tests.numerics import EPS_F32, EPS_TF32


def _gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


@pytest.fixture(params=["interpret", "gpu"])
def backend(request):
  """Yields the backend name; 'gpu' runs with a GPU as the default device (Triton)."""
  if request.param == "interpret":
    yield "interpret"
    return
  gpu = _gpu()
  if gpu is None:
    pytest.skip("no GPU: compiled kernel tests need one (JAX_PLATFORMS=cpu,cuda on a GPU host)")
  with jax.default_device(gpu):
    yield "triton"


def assert_close(got, want, backend, n, msg=""):
  """Scaled to max|want| and the float32 reduction length `n` (tests/numerics.py); Triton's
  f32 dots use TF32 by default, as XLA's GPU matmuls do."""
  numerics.assert_close(got, want, n, EPS_F32 if backend == "interpret" else EPS_TF32, msg)


def objective(y):
  return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.shape[-1]))


def value_and_grads(fn, *args):
  """(fn(*args), d objective / d each arg), in one jitted call."""
  def both(*args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(jax.grad(objective)(out)))
  return jax.jit(both)(*args)


def assert_trees_close(got, want, backend, names, lengths):
  """`lengths`: each output's float32 reduction length, summed along its path from the inputs."""
  for g, w, name, n in zip(got, want, names, lengths, strict=True):
    assert_close(g, w, backend, n, name)


# --- permute ------------------------------------------------------------------------------------

# (tokens, D, output rows, copies per token, block_rows): output rows not a multiple of the
# block, empty rows (-1 and >= T), tokens copied 0..K times, D needing a small tile.
PERMUTE_CASES = [(11, 16, 30, 3, 8), (40, 24, 80, 2, 16), (5, 8, 3, 1, 32)]


@pytest.mark.parametrize("t,d,r,k,block", PERMUTE_CASES, ids=lambda v: str(v))
def test_permute_matches_reference(t, d, r, k, block, backend):
  rng = np.random.default_rng(t)
  token_U = np.repeat(np.arange(t), k)[:r]
  token_U = np.concatenate([token_U, rng.integers(-2, 0, max(0, r - len(token_U)))])
  token_U[rng.random(r) < 0.2] = t + 1                     # out of range: an empty row
  token_U = jnp.asarray(rng.permutation(token_U), jnp.int32)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
  rows_TxK = invert(token_U, t, k)
  tuning = PermuteTuning(block_rows=block, block_d=16, backend=backend)
  got = value_and_grads(lambda x: permute(x, token_U, rows_TxK, tuning), x)
  want = value_and_grads(lambda x: permute_reference(x, token_U), x)
  # out: a copy; dx: a token's k copies summed.
  assert_trees_close(got, want, backend, ["out", "dx"], [1, k])


def test_invert_lists_each_tokens_rows_in_order():
  token_U = jnp.array([2, 0, 2, -1, 5, 0, 2], jnp.int32)
  np.testing.assert_array_equal(np.asarray(invert(token_U, 4, 3)),
                                [[1, 5, -1], [-1, -1, -1], [0, 2, 6], [-1, -1, -1]])


# --- unpermute-combine --------------------------------------------------------------------------

# (tokens, K, rows, D, block_rows); some choices dropped (-1), rows unused, K = 1 and 3.
COMBINE_CASES = [(13, 2, 40, 16, 8), (7, 1, 9, 32, 16), (20, 3, 64, 8, 64)]


@pytest.mark.parametrize("t,k,r,d,block", COMBINE_CASES, ids=lambda v: str(v))
def test_unpermute_combine_matches_reference(t, k, r, d, block, backend):
  rng = np.random.default_rng(r)
  row_TxK = rng.permutation(r)[:t * k].reshape(t, k)
  row_TxK[rng.random((t, k)) < 0.25] = -1                 # dropped choices
  row_TxK = jnp.asarray(row_TxK, jnp.int32)
  rows = jnp.asarray(rng.standard_normal((r, d)), jnp.float32)
  gate = jnp.asarray(rng.random((t, k)), jnp.float32)
  tuning = CombineTuning(block_rows=block, block_d=16, backend=backend)
  got = value_and_grads(lambda a, g: unpermute_combine(a, row_TxK, g, tuning), rows, gate)
  want = value_and_grads(lambda a, g: unpermute_combine_reference(a, row_TxK, g), rows, gate)
  # out: k gated rows summed; d rows: one product; d gate: a dot over D.
  assert_trees_close(got, want, backend, ["out", "d rows", "d gate"], [k, k, k + d])


# --- grouped matmul -----------------------------------------------------------------------------

# (M, I, O, group sizes, block_m): uneven and empty groups, rows past the last group, all
# groups empty, sizes summing past M (clipped).
GMM_CASES = [
    (37, 16, 32, [5, 0, 13, 9], 8),
    (64, 32, 16, [0, 0, 64, 0], 16),
    (20, 16, 16, [0, 0, 0], 8),
    (33, 16, 48, [40, 2, 1], 16),
]


@pytest.mark.parametrize("m,i,o,sizes,block", GMM_CASES, ids=lambda v: str(v))
def test_gmm_matches_reference(m, i, o, sizes, block, backend):
  rng = np.random.default_rng(m)
  x = jnp.asarray(rng.standard_normal((m, i)) / np.sqrt(i), jnp.float32)
  w = jnp.asarray(rng.standard_normal((len(sizes), i, o)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((m, o)), jnp.float32)
  sizes = jnp.asarray(sizes, jnp.int32)
  tuning = GmmTuning(block_m=block, block_k=16, block_n=16, backend=backend)
  got = value_and_grads(lambda x, w: gmm(x, w, sizes, tuning), x, w)
  want = value_and_grads(lambda x, w: gmm_reference(x, w, sizes), x, w)
  # out: a dot over I; dx: then one over O; dw: then a sum over a group's rows (<= M).
  assert_trees_close(got, want, backend, ["out", "dx", "dw"], [i, i + o, i + m])
  assert_close(jax.jit(lambda x, dy: tgmm(x, dy, sizes, tuning))(x, dy),
               tgmm_reference(x, dy, sizes), backend, m, "tgmm")


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,needle", [
    (lambda: permute(jnp.ones((4, 8)), jnp.zeros((3,), jnp.float32), jnp.zeros((4, 1), jnp.int32)),
     "token_U"),
    (lambda: permute(jnp.ones((4, 8)), jnp.zeros((3,), jnp.int32), jnp.zeros((5, 1), jnp.int32)),
     "rows_TxK"),
    (lambda: unpermute_combine(jnp.ones((4, 8)), jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 1))),
     "gate shape"),
    (lambda: gmm(jnp.ones((4, 8)), jnp.ones((2, 6, 4)), jnp.ones((2,), jnp.int32)), "I=6"),
    (lambda: gmm(jnp.ones((4, 8)), jnp.ones((2, 8, 4)), jnp.ones((3,), jnp.int32)),
     "group_sizes"),
    (lambda: gmm(jnp.ones((4, 8)), jnp.ones((2, 8, 4), jnp.bfloat16), jnp.ones((2,), jnp.int32)),
     "cast both"),
    (lambda: gmm(jnp.ones((4, 8)), jnp.ones((2, 8, 4)), jnp.ones((2,), jnp.int32),
                 GmmTuning(block_m=24)), "power of two"),
    (lambda: gmm(jnp.ones((4, 8)), jnp.ones((2, 8, 4)), jnp.ones((2,), jnp.int32),
                 GmmTuning(backend="cuda")), "unknown"),
])
def test_bad_inputs_give_one_line_errors(call, needle):
  with pytest.raises(ValueError) as e:
    call()
  msg = str(e.value)
  assert "\n" not in msg and needle in msg, msg


def test_auto_backend_is_interpret_on_cpu_and_triton_on_gpu():
  assert backend_lib.resolve("auto", "cpu") == "interpret"
  assert backend_lib.resolve("auto", "gpu") == "triton"
  with pytest.raises(ValueError, match="moe.kernels = 'xla'"):
    backend_lib.resolve("auto", "tpu")
  assert backend_lib.pow2_tile(768, 256) == 256 and backend_lib.pow2_tile(24, 256) == 8


# --- lowering for CUDA on a CPU host ------------------------------------------------------------

_CUDA_CALLS = [jax.export.DisabledSafetyCheck.custom_call(n)
               for n in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")]


def lower_for_cuda(fn, *args) -> str:
  return jax.export.export(jax.jit(fn), platforms=["cuda"],
                           disabled_checks=_CUDA_CALLS)(*args).mlir_module()


def test_kernels_fwd_and_bwd_lower_to_triton_inside_shard_map():
  """All kernels, forward and backward, inside shard_map (varying-axes check on), bf16."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  bf16, i32 = jnp.bfloat16, jnp.int32
  pt, ct = PermuteTuning(backend="triton"), CombineTuning(backend="triton")
  gt = GmmTuning(backend="triton")

  def local(x_TxD, w_GxDxF, token_U, rows_TxK, gate_TxK, sizes_G):
    def loss(x, w, gate):
      rows = permute(x, token_U, rows_TxK, pt)
      h = gmm(rows, w, sizes_G, gt)
      h = gmm(h, jnp.swapaxes(w, 1, 2), sizes_G, gt)
      return jnp.sum(unpermute_combine(h, rows_TxK, gate, ct) ** 2)
    grads = jax.grad(loss, argnums=(0, 1, 2))(x_TxD, w_GxDxF, gate_TxK)
    return grads[0], jax.lax.psum(grads[1], "x"), grads[2]

  fn = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x"), P("x"), P()),
                     out_specs=(P("x"), P(), P("x")))
  s = jax.ShapeDtypeStruct
  mlir = lower_for_cuda(fn, s((8 * 96, 256), bf16), s((4, 256, 512), bf16), s((8 * 192,), i32),
                        s((8 * 96, 2), i32), s((8 * 96, 2), jnp.float32), s((4,), i32))
  # fwd: permute, 2 gmm, combine; bwd: combine (2), 2 x (gmm + tgmm), permute.
  assert mlir.count("xla.gpu.triton") == 11


def test_gmm_mosaic_gpu_path_lowers_for_cuda():
  """backend='mosaic_gpu' (JAX's Hopper ragged-dot kernels) lowers for the forward and dx.
  Its dw kernel reads the GPU's SM count when traced, so it cannot be lowered on CPU."""
  from pallas_kernels.gmm_mosaic import ragged_dot
  tuning = GmmTuning(block_m=64, block_k=64, block_n=64, backend="mosaic_gpu")
  s = jax.ShapeDtypeStruct
  for transpose in (False, True):
    mlir = lower_for_cuda(lambda x, w, g, t=transpose: ragged_dot(x, w, g, tuning, t),
                          s((512, 256), jnp.bfloat16), s((4, 256, 256), jnp.bfloat16),
                          s((4,), jnp.int32))
    assert "mosaic_gpu" in mlir
