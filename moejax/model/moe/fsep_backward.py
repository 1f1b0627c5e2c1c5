"""How fsep's backward pass gets each MoE layer's restored expert weights.

The forward pass restores layer l's slot weights from the stored shards (`fsep_experts`) and
hands them to the layer. Autodiff would keep every layer's restored weights from the forward
until its backward pass: L layers of full expert weights alive at once. Instead the layer's
backward recomputes it from weights it gets again (`_recomputing_moe`), in one of three ways,
chosen when the model is built (`fsep_moe`):

  KEEP       plain autodiff: the forward's restored weights are kept (where the re-restoring
             vjp cannot run: pallas_kernels.compat.rerestores_fsep).
  RERESTORE  the backward restores this layer's weights again (one more exchange, on the
             backward's critical path).
  PREFETCH   the backward of layer l restores layer l-1's and hands them back through the
             layer scan as the cotangent of a `channel` the scan carries; the last layer's
             come from `close_channel`, issued before the head's backward. Each restore then
             overlaps the backward compute of the layer after it.

`open_channel` and `close_channel` are the channel's two ends around the layer scan.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from moejax.model.moe.fsep_experts import gathered, restore_layer
from moejax.model.moe.layer import RECORD, RECORD_SHARES, MoELayer

KEEP, RERESTORE, PREFETCH = "keep", "rerestore", "prefetch"

# The name scope of the backward pass's weight restores (the compiled program's op names tell
# them from the forward's restores and from the restores' transposes, the gradient return).
BACKWARD_RESTORE = "backward_restore"


def _backward_restore(stored, slot_expert_LxS, layer, mesh: Mesh, dtype, fsdp: bool,
                      ahead: bool = False):
  """`ahead`: restored for a later layer's backward (PREFETCH), so under FSDP the data-axis
  gather of the embed dim is done here too, where the rest of this layer's backward compute
  can hide it (see `open_channel`)."""
  with jax.named_scope(BACKWARD_RESTORE):
    w = restore_layer(stored, slot_expert_LxS, layer, mesh, dtype, fsdp)
    return gathered(w, mesh) if (fsdp and ahead) else w


def _recomputing_moe(moe: MoELayer, backward_weights, keeps_exchange: bool):
  """`moe(x, layout, weights)`, plus a `channel` passed through unchanged, whose backward
  pass recomputes the layer from weights it gets again instead of the forward keeping every
  layer's restored weights until its backward pass: `backward_weights(ct_channel, stored,
  slot_expert_LxS, layer)` gives (this layer's weights, the cotangent of the channel input).
  The forward keeps the balance loss's global shares and the recompute takes them back
  (moejax.model.moe.kept_exchange): no psum recomputed. `keeps_exchange`: it keeps what the
  layer's exchanges returned too, and the recompute replays them: no token exchange, no down
  projection recomputed."""
  def call(mdl, x, layout, weights, channel, stored, slot_expert_LxS, layer):
    del stored, slot_expert_LxS, layer          # the backward pass's inputs
    return mdl(x, layout, weights), channel

  def fwd(mdl, x, layout, weights, channel, stored, slot_expert_LxS, layer):
    y, stats, kept = mdl(x, layout, weights, RECORD if keeps_exchange else RECORD_SHARES)
    res = (mdl.variables["params"], x, layout, stored, slot_expert_LxS, layer,   # no `weights`
           kept)
    return ((y, stats), channel), res

  def bwd(res, ct):
    params, x, layout, stored, slot_expert_LxS, layer, kept = res
    ct_out, ct_channel = ct
    weights, ct_channel_in = backward_weights(ct_channel, stored, slot_expert_LxS, layer)
    apply = lambda p, x, w: MoELayer(moe.cfg, moe.mesh, moe.dtype).apply({"params": p}, x,
                                                                          layout, w, kept)
    ct_params, ct_x, ct_weights = jax.vjp(apply, params, x, weights)[1](ct_out)
    return {"params": ct_params}, ct_x, None, ct_weights, ct_channel_in, None, None, None

  return nn.custom_vjp(call, fwd, bwd)


def _rerestoring_moe(moe: MoELayer, fsdp: bool, keeps_exchange: bool):
  """`_recomputing_moe` whose backward pass restores this layer's weights again from the
  stored shards (one more exchange); its channel is None."""
  def backward_weights(ct_channel, stored, slot_expert_LxS, layer):
    del ct_channel
    return _backward_restore(stored, slot_expert_LxS, layer, moe.mesh, moe.dtype, fsdp), None

  return _recomputing_moe(moe, backward_weights, keeps_exchange)


def _prefetching_moe(moe: MoELayer, fsdp: bool, keeps_exchange: bool):
  """`_recomputing_moe` whose channel (the shape of one layer's restored weights) carries
  restored weights backwards through the layer scan: layer l's backward pass takes its own
  weights from the cotangent of its channel output (restored during layer l+1's backward, or
  by `close_channel` for the last layer) and returns layer l-1's, restored now, as the
  cotangent of its channel input, so that restore overlaps this layer's backward compute
  instead of preceding it."""
  def backward_weights(ct_channel, stored, slot_expert_LxS, layer):
    previous = (layer - 1) % slot_expert_LxS.shape[0]    # layer 0 wraps: nobody reads it
    return ct_channel, _backward_restore(stored, slot_expert_LxS, previous, moe.mesh, moe.dtype,
                                         fsdp, ahead=True)

  return _recomputing_moe(moe, backward_weights, keeps_exchange)


def _kept(moe: MoELayer, fsdp: bool, keeps_exchange: bool):
  del moe, fsdp, keeps_exchange       # plain autodiff keeps everything the backward reads
  return lambda mdl, x, layout, weights, channel, *backward_inputs: (mdl(x, layout, weights),
                                                                     channel)


def fsep_moe(moe: MoELayer, backward: str, fsdp: bool = False, keeps_exchange: bool = False):
  """call(moe, x, layout, weights, channel, stored, slot_expert_LxS, layer) -> ((y, stats),
  channel): the fsep MoE layer on this layer's restored `weights`, its backward pass getting
  them as `backward` (KEEP, RERESTORE or PREFETCH) says (restored as `restore_layer`'s `fsdp`
  says); `channel` is None but with PREFETCH. `keeps_exchange`: `_recomputing_moe`'s."""
  # read at call time, so that a test can put plain autodiff in one's place
  wrap = {KEEP: _kept, RERESTORE: _rerestoring_moe, PREFETCH: _prefetching_moe}
  if backward not in wrap:
    raise ValueError(f"fsep backward {backward!r} is not one of {tuple(wrap)}")
  return wrap[backward](moe, fsdp, keeps_exchange)


def open_channel(first_weights: dict, mesh: Mesh, fsdp: bool = False) -> dict:
  """The channel the layer scan carries with PREFETCH (zeros shaped like one layer's restored
  weights): only its cotangent, the weights the backward restores, is ever read.

  Under FSDP the channel is laid out gathered over `data`, so its cotangent, the scan's
  backward carry, holds the weights as the layer uses them: the gather runs in the iteration
  that restores them, behind that layer's backward compute. Carried FSDP-sharded, the gather
  ran at the top of the next iteration, where the token exchange queued behind it (Mixtral-
  8x7B on 64 compile-only H100s: 0.28 s of exposed gathers a step;
  docs/decisions/0128-fsep-gathers-a-layer-ahead-and-eight-collectives-in-flight.md)."""
  zeros = jax.tree.map(jnp.zeros_like, first_weights)
  return gathered(zeros, mesh) if fsdp else zeros


def _seed_backward_restore(mesh: Mesh, dtype, fsdp: bool):
  """seed(x, channel, stored, slot_expert_LxS) = x, whose backward restores the last MoE
  layer's weights as the cotangent of the layer scan's final `channel` (`_prefetching_moe`):
  the first backward restore, issued before the head's backward."""
  @jax.custom_vjp
  def seed(x, channel, stored, slot_expert_LxS):
    del channel, stored, slot_expert_LxS
    return x

  def fwd(x, channel, stored, slot_expert_LxS):
    del channel
    return x, (stored, slot_expert_LxS)

  def bwd(res, ct_x):
    stored, slot_expert_LxS = res
    last = _backward_restore(stored, slot_expert_LxS, slot_expert_LxS.shape[0] - 1, mesh, dtype,
                             fsdp, ahead=True)
    return ct_x, last, None, None

  seed.defvjp(fwd, bwd)
  return seed


def close_channel(x: jax.Array, channel: dict, stored: dict, slot_expert_LxS: jax.Array,
                  mesh: Mesh, dtype, fsdp: bool = False) -> jax.Array:
  """`x` (the layer scan's output), whose backward pass feeds the scan's final `channel` the
  last MoE layer's restored weights (PREFETCH; `fsdp`: restore_layer's)."""
  return _seed_backward_restore(mesh, dtype, fsdp)(x, channel, stored, slot_expert_LxS)
