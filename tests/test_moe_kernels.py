"""The MoE layer's build-time options: `moe.kernels` ("xla" | "pallas") and `moe.dispatch`
("dense" | "ragged") give the same layer.

* dense + pallas (kernels interpreted on the CPU mesh) equals dense + xla, drops included.
* ragged is dropless and equals the single-device reference. XLA:CPU has no
  ragged_all_to_all, so on CPU the collective is replaced by `emulated_ragged_all_to_all`
  below (same contract, built from all_to_all); everything around it (counts, offsets,
  grouping, grouped matmul, reverse exchange, combine, autodiff) is the library's code.
  The real collective runs only in the GPU test (skipped without a GPU) and is lowered for
  CUDA, forward and backward, in `test_ragged_path_lowers_for_cuda`.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.config import ConfigError, MoEConfig
from moejax.layout import capacity
from moejax.layout.tables import static_layout
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe import ragged
from moejax.model.moe.harness import layer_step, reference_step
from moejax.model.moe.ops import ops_for
from pallas_kernels import compat
from tests.helpers import TINY_MOE, tiny_setup
from tests.moe_helpers import D, E, F, make_params, row
from tests.numerics import EPS_TF32, assert_close, assert_trees_close

TOKENS = 64        # 8 x 8 in every test below
# float32 reduction lengths along each compared value's path (tests/numerics.py): y = the
# router's dot over D, the experts' over D then F; the loss then sums y's TOKENS x D values;
# gradients go back through F and D and the weights' sum over their tokens' top-2 rows.
Y_LEN = 2 * D + F
LOSS_LEN = Y_LEN + TOKENS * D
GRAD_LEN = Y_LEN + D + F + 2 * TOKENS


def skewed_params(seed=0):
  """Every token picks experts 0 and 1 (positive inputs, ordered router columns)."""
  params = make_params(seed)
  router = np.full((D, E), -10.0, np.float32)
  router[:, 0], router[:, 1] = 10.0, 5.0
  return dict(params, router=jnp.asarray(router))


def positive_tokens(seed=2):
  return jnp.abs(jax.random.normal(jax.random.key(seed), (8, 8, D))) + 0.1


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
def test_dense_pallas_equals_dense_xla_with_drops():
  """(data, expert, model) = (2, 2, 2): 4 slots per device, F split over model; capacity
  factor 1 with half the tokens on two experts, so both drop the same choices."""
  shape = (2, 2, 2)
  params = make_params(7)
  params["router"] = params["router"].at[:, 0].add(1.0)    # skew, so some choices drop
  x = jax.random.normal(jax.random.key(8), (8, 8, D))
  layout = row(static_layout(1, E, shape[1]))
  out = {}
  for kernels in ("xla", "pallas"):
    cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=1.0, d_ff=F, kernels=kernels)
    out[kernels] = layer_step(cfg, mesh_of_shape(shape))(params, x, layout)
  (loss, (y, st)), grads = out["pallas"]
  (ref_loss, (ref_y, ref_st)), ref_grads = out["xla"]
  assert int(np.sum(ref_st.dropped_W)) > 0, "the test should make the dense dispatch drop"
  for name in ("counts_WxE", "dropped_W", "slot_counts_WxS"):
    np.testing.assert_array_equal(getattr(st, name), getattr(ref_st, name), err_msg=name)
  assert_close(y, ref_y, Y_LEN, err_msg="y")
  assert_close(loss, ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(grads, ref_grads, GRAD_LEN)


@pytest.mark.slow   # a minute or more on the 2-core VM: .ci/run's slow pass
@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_ragged_is_dropless_and_matches_reference(kernels, emulated_collective):
  """All tokens on experts 0 and 1: a dense dispatch at capacity factor 1 drops most choices;
  ragged with the worst-case buffer (factor 0) drops none and equals the reference (values and
  gradients)."""
  del emulated_collective
  shape = (2, 2, 2)
  params, x = skewed_params(), positive_tokens()
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=1.0, d_ff=F, kernels=kernels,
                  dispatch="ragged", ragged_buffer_factor=0.0)
  (loss, (y, st)), grads = layer_step(cfg, mesh_of_shape(shape))(
      params, x, row(static_layout(1, E, shape[1])))
  (ref_loss, (ref_y, ref_counts)), ref_grads = reference_step(cfg)(params, x)
  assert int(np.sum(st.dropped_W)) == 0
  np.testing.assert_array_equal(np.asarray(st.counts_WxE).sum(0), np.asarray(ref_counts))
  # 4 sources x 16 tokens, each token on slots 0 and 1: dense capacity would be 4 rows.
  np.testing.assert_array_equal(np.asarray(st.slot_counts_WxS)[:, :2], 16)
  assert_close(y, ref_y, Y_LEN, err_msg="y")
  assert_close(loss, ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(grads, ref_grads, GRAD_LEN)


def test_ragged_on_cpu_fails_at_build_time_with_one_line():
  moe = dataclasses.replace(TINY_MOE, dispatch="ragged")
  with pytest.raises(ConfigError) as e:
    tiny_setup((2, 4, 1), moe_cfg=moe)
  msg = str(e.value)
  assert "\n" not in msg and "XLA:CPU" in msg and "moe.dispatch = 'dense'" in msg, msg


@pytest.mark.parametrize("field,value", [("kernels", "triton"), ("dispatch", "sparse"),
                                         ("pallas_backend", "cuda")])
def test_unknown_option_is_a_one_line_config_error(field, value):
  with pytest.raises(ConfigError, match=f"moe.{field}={value!r}") as e:
    dataclasses.replace(TINY_MOE, **{field: value}).validate()
  assert "\n" not in str(e.value)


def test_ragged_path_lowers_for_cuda():
  """The real ragged_all_to_all path (pallas ops, Triton backend) traced with shard_map's
  varying-axes check on, differentiated, and lowered for CUDA (not compiled)."""
  mesh = mesh_of_shape((1, 4, 2))
  ops = ops_for("pallas", "gpu")
  assert ops.backend == "triton"
  t, d, f, slots = 32, 64, 64, 2
  ROWS = capacity.ragged_rows(t, 2, 4, 2.0)        # noqa: N806  (a shape, named like one)

  def local(x_TxD, slot_TK, gate_TxK, w_gate, w_up, w_down):
    def loss(x, gate, *w):
      y = ragged.ragged_moe(x, slot_TK, gate, w, ops, 4, slots, jnp.bfloat16, ROWS)[0]
      return jnp.sum(y ** 2)
    gx, gg, *gw = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x_TxD, gate_TxK, w_gate, w_up, w_down)
    return gx, gg, *(jax.lax.psum(g, "data") for g in gw)

  w_spec = P("expert", None, "model")
  fn = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"),) * 3 + (w_spec,) * 2 +
                     (P("expert", "model", None),),
                     out_specs=(P("expert"),) * 2 + (w_spec,) * 2 + (P("expert", "model", None),))
  s = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  with compat.cuda_target():
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(n) for n in ("__gpu$xla.gpu.triton",
                                                              "ragged_all_to_all")])(
            s((4 * t, d), bf16), s((4 * t * 2,), jnp.int32), s((4 * t, 2), jnp.float32),
            s((8, d, f), bf16), s((8, d, f), bf16), s((8, f, d), bf16))
  mlir = exported.mlir_module()
  assert mlir.count("ragged_all_to_all") >= 4      # 2 forward + their 2 transposes
  # The forward exchange's receive buffer is the bounded one: 2 x the 64 choices per device.
  assert re.search(rf"tensor<{ROWS}x{d}xbf16>.*ragged_all_to_all|ragged_all_to_all.*"
                   rf"tensor<{ROWS}x{d}xbf16>", mlir), "no receive buffer of ROWS rows"


def _gpus():
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


@pytest.mark.skipif(not _gpus(), reason="no GPU: ragged_all_to_all runs only on GPU/TPU "
                    "(JAX_PLATFORMS=cpu,cuda on a GPU host)")
@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_ragged_on_gpu_matches_reference(kernels):
  gpus = _gpus()
  n = 2 if len(gpus) >= 2 else 1
  mesh = jax.make_mesh((1, n, 1), ("data", "expert", "model"), devices=gpus[:n],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  params, x = skewed_params(), positive_tokens()
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=1.0, d_ff=F, kernels=kernels,
                  dispatch="ragged", ragged_buffer_factor=0.0)
  with jax.default_device(gpus[0]):
    (loss, (y, st)), grads = layer_step(cfg, mesh)(params, x, row(static_layout(1, E, n)))
    (ref_loss, (ref_y, _)), ref_grads = reference_step(cfg)(params, x)
  assert int(np.sum(st.dropped_W)) == 0
  assert_close(y, ref_y, Y_LEN, EPS_TF32, "y")
  assert_close(loss, ref_loss, LOSS_LEN, EPS_TF32, "loss")
  assert_trees_close(grads, ref_grads, GRAD_LEN, EPS_TF32)
