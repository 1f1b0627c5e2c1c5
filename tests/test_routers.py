"""The router family: softmax and sigmoid gates against a plain-jnp reference (outputs and
gradients, with a bias), the sigmoid layer sharded against the single-device reference, and
device-limited routing against a brute-force reference (host-only, tiny shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import MoEConfig
from moejax.layout.tables import from_slot_expert, static_layout
from moejax.model.mesh import mesh_of_shape
from moejax.model.moe.harness import reference_loss, run_against_reference
from moejax.model.moe.layer import hosting_devices, moe_apply
from moejax.model.moe.reference import moe_reference
from moejax.model.moe.route import route
from moejax.train.programs import CompileCounter
from tests.moe_helpers import GRAD_LEN, LOSS_LEN, Y_LEN, D, E, F, make_params, row
from tests.numerics import assert_close, assert_trees_close

T, K, SEQ_LEN = 32, 2, 8


def plain_gate(x_TxD, w_DxE, bias_E, gate, scale):
  """The gates written out: scores, choice by argsort of score + bias, the chosen unbiased
  scores normalised over k and scaled; and the balance loss of each gate."""
  logits = x_TxD @ w_DxE
  scores = jax.nn.softmax(logits, -1) if gate == "softmax" else 1 / (1 + jnp.exp(-logits))
  order = jnp.argsort(-(jax.lax.stop_gradient(scores) + bias_E), axis=-1, stable=True)
  expert = order[:, :K]
  picked = jnp.take_along_axis(scores, expert, -1)
  gates = scale * picked / picked.sum(-1, keepdims=True)
  chosen = (expert[:, :, None] == jnp.arange(E)).any(1).astype(jnp.float32)   # [T, E]
  if gate == "softmax":
    bal = E * jnp.sum(chosen.mean(0) / K * scores.mean(0))
  else:
    norm = (scores / scores.sum(-1, keepdims=True)).reshape(-1, SEQ_LEN, E)
    frac = chosen.reshape(-1, SEQ_LEN, E).sum(1) / (SEQ_LEN * K)
    bal = jnp.mean(E * jnp.sum(frac * norm.mean(1), -1))
  return expert, gates, bal


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_matches_plain_reference(gate, with_bias):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(D, E)) * 0.3, jnp.float32)
  bias = jnp.asarray(rng.normal(size=E) * 0.3 if with_bias else np.zeros(E), jnp.float32)
  scale = 2.5 if gate == "sigmoid" else 1.0
  probe = jnp.asarray(rng.normal(size=(T, K)), jnp.float32)

  def ours(x, w):
    r = route(x, w, K, normalize_top_k=True, bias_E=bias if with_bias else None, gate=gate,
              route_scale=scale, seq_len=SEQ_LEN)
    return jnp.sum(r.gate_TxK * probe) + r.balance_loss, r

  def ref(x, w):
    expert, gates, bal = plain_gate(x, w, bias, gate, scale)
    return jnp.sum(gates * probe) + bal, (expert, gates, bal)

  (val, r), grads = jax.value_and_grad(ours, (0, 1), has_aux=True)(x, w)
  (ref_val, (expert, gates, bal)), ref_grads = jax.value_and_grad(ref, (0, 1), has_aux=True)(
      x, w)
  np.testing.assert_array_equal(r.expert_TxK, expert)
  if with_bias:   # the bias changed some choice, else this test would not test it
    assert not np.array_equal(r.expert_TxK, plain_gate(x, w, 0 * bias, gate, scale)[0])
  assert_close(r.gate_TxK, gates, D + E)
  assert_close(r.balance_loss, bal, D + E + T)
  assert_close(val, ref_val, D + E + T)
  assert_trees_close(grads, ref_grads, 2 * (D + E + T))


@pytest.mark.slow   # a minute on the loaded 2-core VM; the relayout test checks its forward
def test_sigmoid_layer_sharded_matches_reference_with_bias():
  """The sharded layer with the sigmoid gate, a scale and a bias equals the single-device
  reference in outputs and gradients (capacity large enough to drop nothing)."""
  params = make_params(7)
  x = jax.random.normal(jax.random.key(8), (8, 8, D))
  bias = np.linspace(-0.2, 0.2, E, dtype=np.float32)[None]
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=float(E), d_ff=F, gate="sigmoid",
                  route_scale=2.5)
  layout = static_layout(1, E, 4).replace(router_bias_LxE=jnp.asarray(bias))
  # the reference routes as cfg does (sigmoid, scale 2.5), with the layout's bias
  run = run_against_reference(cfg, mesh_of_shape((2, 4, 1)), params, x, row(layout),
                              reference=reference_loss(cfg, bias_E=jnp.asarray(bias[0])))
  np.testing.assert_array_equal(np.asarray(run.stats.counts_WxE).sum(0), run.ref_counts)
  assert_close(run.y, run.ref_y, Y_LEN, err_msg="y")
  assert_close(run.loss, run.ref_loss, LOSS_LEN, err_msg="loss")
  assert_trees_close(run.grads, run.ref_grads, GRAD_LEN)


def brute_force_device_limited(choice_TxE, slot_expert_S, num_dev, limit, k):
  """For each token: every device's best hosted score, the `limit` best devices, then the
  k best experts among all they host (scores are distinct floats: no ties)."""
  slots = len(slot_expert_S) // num_dev
  hosted = [set(slot_expert_S[n * slots:(n + 1) * slots].tolist()) for n in range(num_dev)]
  out = []
  for scores in choice_TxE:
    best = [max(scores[e] for e in hosted[n]) for n in range(num_dev)]
    devices = sorted(range(num_dev), key=lambda n: -best[n])[:limit]
    allowed = sorted(set().union(*(hosted[n] for n in devices)), key=lambda e: -scores[e])
    out.append(allowed[:k])
  return np.array(out)


@pytest.mark.parametrize("limit,k", [(1, 2), (2, 3)])
def test_device_limited_routing_equals_brute_force_and_stays_on_m_devices(limit, k):
  rng = np.random.default_rng(1)
  num_dev = 4
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(D, E)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=E) * 0.05, jnp.float32)
  slot_expert = rng.permutation(E)
  device_of_E = np.argsort(slot_expert) // (E // num_dev)
  slots_ExR = np.argsort(slot_expert)[:, None]                 # ep: each expert's one slot
  hosts = hosting_devices(jnp.asarray(slots_ExR), num_dev, E // num_dev)
  for gate in ("softmax", "sigmoid"):
    r = route(x, w, k, normalize_top_k=True, bias_E=bias, gate=gate, hosts_ExN=hosts,
              device_limit=limit)
    scores = np.asarray(jax.nn.softmax(x @ w) if gate == "softmax" else jax.nn.sigmoid(x @ w))
    want = brute_force_device_limited(scores + np.asarray(bias), slot_expert, num_dev, limit, k)
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_TxK), 1), np.sort(want, 1))
    assert max(len(set(device_of_E[e])) for e in np.asarray(r.expert_TxK)) <= limit
    # Without the limit some token would have used more devices: the limit was binding.
    free = route(x, w, k, normalize_top_k=True, bias_E=bias, gate=gate).expert_TxK
    assert max(len(set(device_of_E[e])) for e in np.asarray(free)) > limit


def test_relayout_changes_device_limited_routing_without_compiling():
  """The hosting devices come from the layout (data): the same compiled layer routes
  differently under another layout, compiles nothing for it, and keeps each token's choices
  on one device of the layout it runs under (device_limit = 1). The sharded layer, with the
  sigmoid gate, a scale and a bias, equals the single-device reference."""
  params = make_params(9)
  x = jax.random.normal(jax.random.key(10), (8, 8, D))
  bias_E = jnp.linspace(-0.1, 0.1, E)
  cfg = MoEConfig(num_experts=E, top_k=2, capacity_factor=float(E), d_ff=F, device_limit=1,
                  gate="sigmoid", route_scale=2.5)
  mesh = mesh_of_shape((1, 4, 1))
  layer = jax.jit(lambda p, x, lay: moe_apply(p, x, lay, cfg, mesh))
  reference = jax.jit(lambda p, x, hosts: moe_reference(
      p, x, 2, bias_E=bias_E, hosts_ExN=hosts, device_limit=1, gate="sigmoid",
      route_scale=2.5)[:2])
  choices = jax.jit(lambda x, hosts: route(
      x.reshape(-1, D), params["router"], 2, normalize_top_k=True, bias_E=bias_E,
      gate="sigmoid", hosts_ExN=hosts, device_limit=1).expert_TxK)
  order = np.array([0, 2, 4, 6, 1, 3, 5, 7])
  counts = {}
  for name, lay, slot_params in (
      ("static", static_layout(1, E, 4), params),
      ("moved", from_slot_expert(order[None], E),
       dict(params, **{w: params[w][order] for w in ("w_gate", "w_up", "w_down")}))):
    lay = lay.replace(router_bias_LxE=bias_E[None])
    with CompileCounter() as compiles:
      y, st = layer(slot_params, x, row(lay))
      jax.block_until_ready(y)
    if name == "moved":
      assert compiles.count == 0
    counts[name] = np.asarray(st.counts_WxE).sum(0)
    hosts = hosting_devices(row(lay).expert_slots_LxExR, 4, 2)
    ref_y, ref_counts = reference(params, x, hosts)
    np.testing.assert_array_equal(counts[name], ref_counts)
    assert_close(y, ref_y, Y_LEN, err_msg=name)
    device_of_E = np.asarray(row(lay).expert_slot_LxE) // 2
    chosen_devices = device_of_E[np.asarray(choices(x, hosts))]
    assert np.all(chosen_devices.max(1) == chosen_devices.min(1))
  assert not np.array_equal(counts["static"], counts["moved"])
