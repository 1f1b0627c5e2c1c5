"""Each Pallas kernel equals its plain-jnp reference, outputs and gradients.

`interpret` runs everywhere (CI: 8 fake CPU devices). `gpu` runs the same cases compiled with
the Triton backend on a GPU and skips without one (tests/conftest.py adds the GPU platform
whenever a CUDA or ROCm plugin and its device node are present). Every kernel is also checked
in bf16 against its float32 reference. The `lower_for_cuda` tests run on CPU: they lower the
kernels (forward and backward, inside shard_map with its varying-axes check on) to Triton /
Mosaic GPU IR for CUDA, which catches unsupported ops and shapes but compiles and runs
nothing; `python -m benchmarks.kernels.gpu_compile` compiles that IR for sm_90a.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import backend as backend_lib, compat, gmm_hopper
from pallas_kernels.grouped_matmul import GmmTuning, gmm, gmm_reference, tgmm, tgmm_reference
from pallas_kernels.permute import PermuteTuning, invert, permute, permute_reference
from pallas_kernels.unpermute import (
  CombineTuning,
  unpermute_combine,
  unpermute_combine_reference,
)
from tests import numerics
from tests.numerics import EPS_BF16, EPS_F32, EPS_TF32


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
    pytest.skip("no GPU visible to JAX: compiled kernel tests need one")
  with jax.default_device(gpu):
    yield "triton"


def assert_close(got, want, backend, n, msg="", eps=None):
  """Scaled to max|want| and the float32 reduction length `n` (tests/numerics.py); Triton's
  f32 dots use TF32 by default, as XLA's GPU matmuls do."""
  eps = eps or (EPS_F32 if backend == "interpret" else EPS_TF32)
  numerics.assert_close(got, want, n, eps, msg)


def gpu_block(block, backend):
  """Matmul row tiles below 16 are interpret-only (Triton's tl.dot needs >= 16)."""
  return block if backend == "interpret" else max(block, backend_lib.MIN_DOT_TILE)


def objective(y):
  return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.shape[-1]))


def value_and_grads(fn, *args):
  """(fn(*args), d objective / d each arg), in one jitted call."""
  def both(*args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(jax.grad(objective)(out)))
  return jax.jit(both)(*args)


def assert_trees_close(got, want, backend, names, lengths, eps=None):
  """`lengths`: each output's float32 reduction length, summed along its path from the inputs."""
  for g, w, name, n in zip(got, want, names, lengths, strict=True):
    assert_close(g, w, backend, n, name, eps)


# --- permute ------------------------------------------------------------------------------------

# (tokens, D, output rows, copies per token, block_rows): output rows not a multiple of the
# block, empty rows (-1 and >= T), tokens copied 0..K times, D needing a small tile.
# Only the last runs in the README's test command; .ci/run's slow pass runs all three.
PERMUTE_CASES = [pytest.param(11, 16, 30, 3, 8, marks=pytest.mark.slow),
                 pytest.param(40, 24, 80, 2, 16, marks=pytest.mark.slow), (5, 8, 3, 1, 32)]


@pytest.mark.parametrize("t,d,r,k,block", PERMUTE_CASES, ids=lambda v: str(v))
def test_permute_matches_reference(t, d, r, k, block, backend):
  rng = np.random.default_rng(t)
  token_rows = np.repeat(np.arange(t), k)[:r]
  token_rows = np.concatenate([token_rows, rng.integers(-2, 0, max(0, r - len(token_rows)))])
  token_rows[rng.random(r) < 0.2] = t + 1                     # out of range: an empty row
  token_rows = jnp.asarray(rng.permutation(token_rows), jnp.int32)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
  rows_TxK = invert(token_rows, t, k)
  tuning = PermuteTuning(block_rows=block, block_d=16, backend=backend)
  got = value_and_grads(lambda x: permute(x, token_rows, rows_TxK, tuning), x)
  want = value_and_grads(lambda x: permute_reference(x, token_rows), x)
  # out: a copy; dx: a token's k copies summed.
  assert_trees_close(got, want, backend, ["out", "dx"], [1, k])


def test_invert_lists_each_tokens_rows_in_order():
  token_rows = jnp.array([2, 0, 2, -1, 5, 0, 2], jnp.int32)
  np.testing.assert_array_equal(np.asarray(invert(token_rows, 4, 3)),
                                [[1, 5, -1], [-1, -1, -1], [0, 2, 6], [-1, -1, -1]])


# --- unpermute-combine --------------------------------------------------------------------------

# (tokens, K, rows, D, block_rows); some choices dropped (-1), rows unused, K = 1 and 3.
# The first two run only in .ci/run's slow pass (the README test command's 8-minute budget).
COMBINE_CASES = [pytest.param(13, 2, 40, 16, 8, marks=pytest.mark.slow),
                 pytest.param(7, 1, 9, 32, 16, marks=pytest.mark.slow), (20, 3, 64, 8, 64)]


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
# The last three run only in .ci/run's slow pass (the README test command's 8-minute budget).
GMM_CASES = [
    (37, 16, 32, [5, 0, 13, 9], 8),
    pytest.param(20, 16, 16, [0, 0, 0], 8, marks=pytest.mark.slow),
    pytest.param(64, 32, 16, [0, 0, 64, 0], 16, marks=pytest.mark.slow),
    pytest.param(33, 16, 48, [40, 2, 1], 16, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("m,i,o,sizes,block", GMM_CASES, ids=lambda v: str(v))
def test_gmm_matches_reference(m, i, o, sizes, block, backend):
  rng = np.random.default_rng(m)
  x = jnp.asarray(rng.standard_normal((m, i)) / np.sqrt(i), jnp.float32)
  w = jnp.asarray(rng.standard_normal((len(sizes), i, o)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((m, o)), jnp.float32)
  sizes = jnp.asarray(sizes, jnp.int32)
  tuning = GmmTuning(block_m=gpu_block(block, backend), block_k=16, block_n=16, backend=backend)
  got = value_and_grads(lambda x, w: gmm(x, w, sizes, tuning), x, w)
  want = value_and_grads(lambda x, w: gmm_reference(x, w, sizes), x, w)
  # out: a dot over I; dx: then one over O; dw: then a sum over a group's rows (<= M).
  assert_trees_close(got, want, backend, ["out", "dx", "dw"], [i, i + o, i + m])
  assert_close(jax.jit(lambda x, dy: tgmm(x, dy, sizes, tuning))(x, dy),
               tgmm_reference(x, dy, sizes), backend, m, "tgmm")


# --- bf16 against the float32 reference ----------------------------------------------------------

def _bf16(rng, shape, scale=1.0):
  """bf16 inputs and the same values in float32, for the reference."""
  x = jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)
  return x, x.astype(jnp.float32)


@pytest.mark.slow   # the README command's budget; .ci/run's passes on both jax releases run it
def test_permute_bf16(backend):
  rng = np.random.default_rng(1)
  t, d, k = 11, 16, 3
  token_rows = jnp.asarray(rng.permutation(np.repeat(np.arange(t), k)), jnp.int32)
  rows_TxK = invert(token_rows, t, k)
  x, x32 = _bf16(rng, (t, d))
  tuning = PermuteTuning(block_rows=8, block_d=16, backend=backend)
  got = value_and_grads(lambda x: permute(x, token_rows, rows_TxK, tuning), x)
  want = value_and_grads(lambda x: permute_reference(x, token_rows), x32)
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
  assert_trees_close(got, want, backend, ["out", "dx"], [1, k], EPS_BF16)


@pytest.mark.slow   # the README command's budget; .ci/run's passes on both jax releases run it
def test_unpermute_combine_bf16(backend):
  rng = np.random.default_rng(2)
  t, k, r, d = 13, 2, 40, 16
  row_TxK = jnp.asarray(rng.permutation(r)[:t * k].reshape(t, k), jnp.int32)
  rows, rows32 = _bf16(rng, (r, d))
  gate = jnp.asarray(rng.random((t, k)), jnp.float32)
  tuning = CombineTuning(block_rows=8, block_d=16, backend=backend)
  got = value_and_grads(
      lambda a, g: unpermute_combine(a, row_TxK, g, tuning, jnp.bfloat16), rows, gate)
  want = value_and_grads(lambda a, g: unpermute_combine_reference(a, row_TxK, g), rows32, gate)
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
  assert_trees_close(got, want, backend, ["out", "d rows", "d gate"], [k, k, k + d], EPS_BF16)


def _hopper_gpu() -> bool:
  return backend_lib.is_hopper(compat.compute_capability(_gpu()))


def _tuning(gmm_backend, backend, block_m, **tiles):
  """'same': the test's backend; 'mosaic_gpu': JAX's Hopper kernel (dw on Triton); 'hopper':
  this package's Hopper kernels, dw included."""
  if gmm_backend == "same":
    return GmmTuning(block_m=gpu_block(block_m, backend), backend=backend, **tiles)
  return GmmTuning(block_m=64, backend="mosaic_gpu", mosaic_kernel=(
      "hopper" if gmm_backend == "hopper" else "jax"), mosaic_dw=gmm_backend == "hopper",
                   **tiles)


@pytest.mark.slow   # the README command's budget; .ci/run's passes on both jax releases run it
@pytest.mark.parametrize("gmm_backend", ["same", "mosaic_gpu", "hopper"])
def test_gmm_bf16(backend, gmm_backend):
  """bf16 operands (I, O multiples of 64, as Mosaic GPU needs); 'mosaic_gpu' and 'hopper' run
  on a Hopper GPU only."""
  if gmm_backend != "same" and not (backend == "triton" and _hopper_gpu()):
    pytest.skip("Mosaic GPU kernels run on a Hopper GPU only")
  rng = np.random.default_rng(3)
  m, i, o, sizes = 37, 64, 64, jnp.asarray([5, 0, 13, 9], jnp.int32)
  x, x32 = _bf16(rng, (m, i), 1 / np.sqrt(i))
  w, w32 = _bf16(rng, (len(sizes), i, o))
  tuning = _tuning(gmm_backend, backend, 8, block_k=64, block_n=64)  # Mosaic: 64 wgmma rows
  got = value_and_grads(lambda x, w: gmm(x, w, sizes, tuning), x, w)
  want = value_and_grads(lambda x, w: gmm_reference(x, w, sizes), x32, w32)
  assert all(g.dtype == jnp.bfloat16 for g in got)
  assert_trees_close(got, want, backend, ["out", "dx", "dw"], [i, i + o, i + m], EPS_BF16)


@pytest.mark.parametrize("gmm_backend", ["same", "mosaic_gpu", "hopper"])
def test_gmm_under_vmap_equals_each_element(backend, gmm_backend):
  """vmap over a leading axis (the pipeline's stages) gives each element's own gmm, values
  and gradients; each element has its own group sizes. Mosaic GPU runs on a Hopper GPU only
  (its lowering under vmap is checked on CPU below)."""
  if gmm_backend != "same" and not (backend == "triton" and _hopper_gpu()):
    pytest.skip("Mosaic GPU kernels run on a Hopper GPU only")
  rng = np.random.default_rng(5)
  m, i, o = 37, 64, 64
  sizes_BxC = jnp.asarray([[5, 0, 13, 9], [20, 17, 0, 0]], jnp.int32)
  x, x32 = _bf16(rng, (2, m, i), 1 / np.sqrt(i))
  w, w32 = _bf16(rng, (2, 4, i, o))
  tuning = _tuning(gmm_backend, backend, 16, block_k=64, block_n=64)
  got = value_and_grads(jax.vmap(lambda x, w, s: gmm(x, w, s, tuning)),
                        x, w, sizes_BxC)[:3]
  for b in range(2):
    ref = functools.partial(gmm_reference, group_sizes_C=sizes_BxC[b])
    want = value_and_grads(ref, x32[b], w32[b])
    assert_trees_close([g[b] for g in got], want, backend, ["out", "dx", "dw"],
                       [i, i + o, i + m], EPS_BF16)


# --- this package's Hopper kernels, in Mosaic GPU's interpreter ----------------------------------

MOSAIC_INTERPRET = compat.mosaic_gpu_interpret(detect_races=True)
needs_mosaic_interpreter = pytest.mark.skipif(
    MOSAIC_INTERPRET is None, reason="jax 0.10's Mosaic GPU interpreter cannot read an SMEM "
    "tile transposed (a wgmma operand); the kernels' lowering is checked below")


# (split, transpose_rhs, group sizes, block_n, chain) over 200 rows: an empty group, rows past
# the last group, groups that start and end inside a CTA's rows, at odd rows too (stored row
# by row from the shifted plain buffer) and that
# cover whole ones (stored swizzled), sizes summing past the rows (clipped); the epilogue in
# two column chunks (block_n 128); tiles chained on an SM or not.
@needs_mosaic_interpreter
@pytest.mark.parametrize("split,transpose_rhs,sizes,block_n,chain", [
    ("n", False, [51, 0, 129, 11], 128, True),      # groups starting at odd rows
    pytest.param("m", True, [120, 0, 70, 40], 64, True, marks=pytest.mark.slow),
    pytest.param("n", True, [0, 200, 0, 0], 64, False, marks=pytest.mark.slow)])
def test_hopper_gmm_matches_reference_interpreted(split, transpose_rhs, sizes, block_n, chain):
  """gmm_hopper.gmm on three simulated SMs (each with its producer and two consumer
  warpgroups; one SM gets a single tile, the others a chain), the uninitialised memory NaN:
  every output row written, tail rows zero; the race detector on (its verdict is the run's
  so far: the kernels only run in these tests)."""
  rng = np.random.default_rng(7)
  m, i, o = 200, 128, 256
  x, x32 = _bf16(rng, (m, i), 1 / np.sqrt(i))
  w, w32 = _bf16(rng, (4, o, i) if transpose_rhs else (4, i, o))
  sizes = jnp.asarray(sizes, jnp.int32)
  got = gmm_hopper.gmm(x, w, sizes, block_m=64, block_n=block_n, block_k=64,
                       max_concurrent_steps=2, split=split, transpose_rhs=transpose_rhs,
                       chain=chain, num_sms=3, interpret=MOSAIC_INTERPRET)
  want = gmm_reference(x32, jnp.swapaxes(w32, 1, 2) if transpose_rhs else w32, sizes)
  assert got.dtype == jnp.bfloat16
  numerics.assert_close(got, want, i, EPS_BF16, "gmm")
  assert not compat.mosaic_gpu_races_found()


@pytest.mark.parametrize("row_bytes,block_m", [(64, 64), (64, 128), (128, 64), (256, 128)])
def test_hopper_gmm_row_stores_start_tma_aligned(row_bytes, block_m):
  """Every TMA store of the row-by-row epilogue reads shared memory at a 128-byte aligned
  address, for every first row and row count of a group inside a tile: the shift of the
  plain buffer and the pieces the store walks (the H200 faulted with
  CUDA_ERROR_MISALIGNED_ADDRESS on 64-byte rows starting at an odd row, which Mosaic GPU's
  interpreter does not check)."""
  align = gmm_hopper.TMA_SMEM_ALIGN
  rows = gmm_hopper.plain_rows(block_m, row_bytes)
  assert rows * row_bytes % align == 0          # the second warpgroup's buffer starts aligned
  unshifted = set()
  for offset in range(block_m):
    shift = gmm_hopper.plain_shift(offset, row_bytes)
    for count in range(1, block_m - offset + 1):
      for size, start in gmm_hopper._ladder(offset, count, block_m):
        if count & size:
          assert (shift + start) * row_bytes % align == 0, (offset, count, size, start)
          assert shift + start + size <= rows                 # inside the buffer
          unshifted.add(start * row_bytes % align == 0)
  assert unshifted == ({True} if row_bytes % align == 0 else {True, False})


def test_hopper_gmm_refuses_epilogue_rows_it_cannot_align():
  x = jnp.zeros((128, 128), jnp.bfloat16)
  w = jnp.zeros((2, 128, 256), jnp.bfloat16)
  assert gmm_hopper.gmm_unsupported(x, w, 64, 128, 64, "n", False) is None
  why = gmm_hopper.gmm_unsupported(x, w, 64, 128, 64, "n", False, epilogue_n=16)
  assert "rows of 32 bytes" in why and "multiples of 32" in why, why


@needs_mosaic_interpreter
@pytest.mark.parametrize("sizes", [[50, 0, 70, 41], pytest.param([100, 150, 0, 10],
                                                                 marks=pytest.mark.slow)])
def test_hopper_tgmm_matches_reference_interpreted(sizes):
  """gmm_hopper.tgmm: groups starting and ending inside a block of rows (masked), an empty
  group (zeros), rows past the last group (ignored), sizes past the rows (clipped)."""
  rng = np.random.default_rng(8)
  m, i, o = 200, 128, 64
  x, x32 = _bf16(rng, (m, i))
  dy, dy32 = _bf16(rng, (m, o))
  sizes = jnp.asarray(sizes, jnp.int32)
  got = gmm_hopper.tgmm(x, dy, sizes, block_m=64, block_n=64, block_k=32,
                        max_concurrent_steps=2, num_sms=2, interpret=MOSAIC_INTERPRET)
  numerics.assert_close(got, tgmm_reference(x32, dy32, sizes), m, EPS_BF16, "tgmm")
  assert not compat.mosaic_gpu_races_found()


def test_hopper_work_list_covers_each_row_once():
  """Per (row tile, group) pair the rows [lo, hi) it stores: together every row exactly once,
  each inside its tile and its group (the tail group C past the last group, its pairs last)."""
  sizes, m, tile_m = jnp.asarray([5, 0, 300, 9, 0], jnp.int32), 400, 128
  tile, group, lo, hi, count = map(np.asarray, gmm_hopper.work_list(sizes, m, tile_m))
  n = int(count[1])
  assert n <= len(tile) == -(-m // tile_m) + len(sizes)
  assert (group[:count[0]] < len(sizes)).all() and (group[count[0]:n] == len(sizes)).all()
  covered = np.zeros(m, int)
  ends = np.minimum(np.cumsum(sizes), m)
  for t, g, a, b in zip(tile[:n], group[:n], lo[:n], hi[:n], strict=True):
    assert t * tile_m <= a < b <= (t + 1) * tile_m
    assert (g == len(sizes) and a >= ends[-1]) or ends[g] - sizes[g] <= a and b <= ends[g]
    covered[a:b] += 1
  assert (covered == 1).all()


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,needle", [
    (lambda: permute(jnp.ones((4, 8)), jnp.zeros((3,), jnp.float32), jnp.zeros((4, 1), jnp.int32)),
     "token_rows"),
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
    (lambda: gmm(jnp.ones((4, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16),
                 jnp.ones((2,), jnp.int32), GmmTuning(block_m=16, backend="mosaic_gpu")),
     "block_m=16 is not a multiple of 64"),
    (lambda: gmm(jnp.ones((4, 8)), jnp.ones((2, 8, 4)), jnp.ones((2,), jnp.int32),
                 GmmTuning(backend="cuda")), "unknown"),
    (lambda: gmm(jnp.ones((4, 16)), jnp.ones((2, 16, 16)), jnp.ones((2,), jnp.int32),
                 GmmTuning(block_m=8, backend="triton")), "GmmTuning.block_m=8 is below 16"),
    (lambda: tgmm(jnp.ones((4, 16)), jnp.ones((4, 16)), jnp.ones((2,), jnp.int32),
                  GmmTuning(block_m=8, backend="mosaic_gpu")), "GmmTuning.block_m=8 is below"),
    (lambda: gmm(jnp.ones((4, 16)), jnp.ones((2, 16, 16)), jnp.ones((2,), jnp.int32),
                 GmmTuning(backend="mosaic_gpu")), "bf16/f16"),
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


@pytest.mark.parametrize("requested,platform,capability,dtype,want", [
    ("auto", "gpu", "9.0", jnp.bfloat16, "mosaic_gpu"),     # Hopper, bf16: Mosaic GPU
    ("auto", "gpu", "9.0", jnp.float16, "mosaic_gpu"),
    ("auto", "gpu", "9.0", jnp.float32, "triton"),          # Mosaic's kernel is bf16/f16 only
    ("auto", "gpu", "8.9", jnp.bfloat16, "triton"),         # L40S, L4: not Hopper
    ("auto", "gpu", "10.0", jnp.bfloat16, "triton"),        # Blackwell: not this kernel's
    ("auto", "gpu", None, jnp.bfloat16, "triton"),          # unknown GPU
    ("auto", "cpu", None, jnp.bfloat16, "interpret"),
    ("triton", "gpu", "9.0", jnp.bfloat16, "triton"),       # an explicit choice stays
    ("mosaic_gpu", "gpu", "8.0", jnp.bfloat16, "mosaic_gpu"),
])
def test_auto_gmm_backend_is_mosaic_gpu_on_hopper(requested, platform, capability, dtype, want):
  assert backend_lib.resolve_gmm(requested, platform, capability, dtype) == want


class _FakeGpu:
  platform = "gpu"

  def __init__(self, kind, capability=None):
    self.device_kind, self.compute_capability = kind, capability


@pytest.mark.parametrize("kind,capability,sms", [
    ("NVIDIA H800", "9.0", 132), ("NVIDIA H20", "9.0", 78), ("NVIDIA L40S", "8.9", 142),
    ("NVIDIA H100 PCIe", "9.0", 114), ("NVIDIA H100 80GB HBM3", "9.0", 132),
])
def test_gpus_jax_does_not_list_are_known_by_kind(kind, capability, sms):
  assert compat.compute_capability(_FakeGpu(kind)) == capability
  assert compat.num_sms(_FakeGpu(kind)) == sms
  # A device's own compute capability wins over the table; a CPU has none.
  assert compat.compute_capability(_FakeGpu(kind, "8.6")) == "8.6"
  assert compat.compute_capability(jax.devices("cpu")[0]) is None


# --- lowering for CUDA on a CPU host ------------------------------------------------------------

_CUDA_CALLS = [jax.export.DisabledSafetyCheck.custom_call(n)
               for n in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")]


def lower_for_cuda(fn, *args, target=compat.DEFAULT_TARGET) -> str:
  with compat.cuda_target(target):
    return jax.export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=_CUDA_CALLS)(*args).mlir_module()


def custom_calls(mlir: str, prefix: str) -> int:
  return len(re.findall(rf"custom_call @{re.escape(prefix)}\w*\(", mlir))


# Triton calls / Mosaic GPU calls per gmm backend. fwd: permute, 2 gmm, combine; bwd: combine
# (2), 2 x (gmm dx + tgmm dw), permute. Mosaic GPU runs each gmm and dx, Triton the rest; with
# this package's Hopper kernels ('hopper'), dw too.
LOWERED_CALLS = {"triton": (11, 0), "mosaic_gpu": (7, 4), "hopper": (5, 6)}
GMM_TUNINGS = {"triton": GmmTuning(backend="triton"), "mosaic_gpu": GmmTuning(backend="mosaic_gpu"),
               "hopper": GmmTuning(backend="mosaic_gpu", mosaic_kernel="hopper", mosaic_dw=True)}


@pytest.mark.slow   # the README command's budget; .ci/run's passes on both jax releases run it
@pytest.mark.parametrize("gmm_backend", sorted(LOWERED_CALLS))
def test_kernels_fwd_and_bwd_lower_for_cuda_inside_shard_map(gmm_backend):
  """All kernels, forward and backward, inside shard_map (varying-axes check on), bf16, with
  the grouped matmul on Triton or Mosaic GPU. The expert weights are replicated over the mesh
  axis and the tokens are not, so every backward output must come back typed as varying like
  its input (Mosaic GPU's dx and dw included)."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  bf16, i32 = jnp.bfloat16, jnp.int32
  pt, ct = PermuteTuning(backend="triton"), CombineTuning(backend="triton")
  gt = GMM_TUNINGS[gmm_backend]

  def local(x_TxD, w_CxDxffn, token_rows, rows_TxK, gate_TxK, sizes_C):
    def loss(x, w, gate):
      rows = permute(x, token_rows, rows_TxK, pt)
      h = gmm(rows, w, sizes_C, gt)
      h = gmm(h, jnp.swapaxes(w, 1, 2), sizes_C, gt)
      return jnp.sum(unpermute_combine(h, rows_TxK, gate, ct) ** 2)
    grads = jax.grad(loss, argnums=(0, 1, 2))(x_TxD, w_CxDxffn, gate_TxK)
    return grads[0], jax.lax.psum(grads[1], "x"), grads[2]

  fn = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x"), P("x"), P()),
                     out_specs=(P("x"), P(), P("x")))
  s = jax.ShapeDtypeStruct
  mlir = lower_for_cuda(fn, s((8 * 96, 256), bf16), s((4, 256, 512), bf16), s((8 * 192,), i32),
                        s((8 * 96, 2), i32), s((8 * 96, 2), jnp.float32), s((4,), i32))
  triton, mosaic = LOWERED_CALLS[gmm_backend]
  assert (custom_calls(mlir, "__gpu$xla.gpu.triton"), custom_calls(mlir, "mosaic_gpu")) == (
      triton, mosaic)


@pytest.mark.parametrize("gmm_backend", [pytest.param("triton", marks=pytest.mark.slow),
                                         "mosaic_gpu",
                                         pytest.param("hopper", marks=pytest.mark.slow)])
def test_gmm_fwd_and_bwd_lower_for_cuda_under_vmap(gmm_backend):
  """The pipeline runs its stages as one vmap, of one stage when train.microbatches > 1 on
  one GPU: the grouped matmul, forward, dx and dw, must lower batched. Mosaic GPU's kernel
  cannot take Pallas's batching (its group sizes arrive as a sliced ref: "object of type
  'TransformedRef' has no len()"), so it runs once per batch element."""
  bf16, i32 = jnp.bfloat16, jnp.int32
  tuning = GMM_TUNINGS[gmm_backend]

  def step(x, w, sizes):
    return jax.grad(lambda x, w: objective(gmm(x, w, sizes, tuning)), argnums=(0, 1))(x, w)

  s = jax.ShapeDtypeStruct
  for batch in (1, 2):
    mlir = lower_for_cuda(jax.vmap(step), s((batch, 72, 128), bf16), s((batch, 4, 128, 128), bf16),
                          s((batch, 4), i32))
    assert custom_calls(mlir, "__gpu$xla.gpu.triton" if gmm_backend == "triton" else
                        "mosaic_gpu") > 0, batch


def test_cuda_target_is_what_lets_jax_0_11_lower_triton_without_a_gpu():
  """jax 0.11 asks its GPU table for the device it lowers for; on this CPU host only
  `compat.cuda_target` answers it (H800 / H20 / L40S by their architecture's kind). jax 0.10
  always assumes compute capability 9.0 there and refuses any other target."""
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  token_rows = jax.ShapeDtypeStruct((96,), jnp.int32)
  rows_TxK = jax.ShapeDtypeStruct((64, 2), jnp.int32)
  fn = lambda x, t, r: permute(x, t, r, PermuteTuning(backend="triton"))
  if compat.JAX_VERSION < (0, 11):
    assert custom_calls(lower_for_cuda(fn, x, token_rows, rows_TxK, target="NVIDIA H800"),
                        "__gpu$xla.gpu.triton") == 1
    with pytest.raises(ValueError, match="compute capability 9.0 only"):
      lower_for_cuda(fn, x, token_rows, rows_TxK, target="NVIDIA L40S")
    return
  for target in ("NVIDIA H800", "NVIDIA H20", "NVIDIA L40S"):
    mlir = lower_for_cuda(fn, x, token_rows, rows_TxK, target=target)
    assert custom_calls(mlir, "__gpu$xla.gpu.triton") == 1, target
  with pytest.raises(RuntimeError, match="No supported GPU devices found"):
    jax.export.export(jax.jit(lambda x, t, r: fn(x + 1, t, r)), platforms=["cuda"],
                      disabled_checks=_CUDA_CALLS)(x, token_rows, rows_TxK)
