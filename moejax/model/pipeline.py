"""The transformer's layer groups as a pipeline over the `stage` mesh axis: GPipe, or circular.

The G scanned layer groups split into P stages x V chunks (V: `train.virtual_stages`; 1 for
GPipe) of K = G/(P*V) whole groups, stored together per stage in the `layers` axis sharded
over `stage` (moejax.model.layer_order), so the split moves no data. The batch splits into M
microbatches (rows i % M == m: each device's rows of a microbatch are rows it holds). One
schedule of V*M + P - 1 ticks serves both, one `ppermute` rotation over `stage` a tick
(`pipelined_apply` says how); the backward pass is the ticks' autodiff. Every stage runs the
same program: one `vmap` over the stages with `spmd_axis_name='stage'`, so each MoE layer's
`shard_map` keeps its expert parallelism inside each stage. The Transformer's other parts (its
`embed` and `head`) are replicated over `stage`, as SPMD makes them.

`Pipelined` has the Transformer's `init` and `apply`, so the train and eval steps take it as
the model. Its loss is the step's loss over the whole batch with each MoE layer's balance and
z losses the mean over the microbatches (their values on the whole batch with M = 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import num_moe_layers
from moejax.layout.tables import Layout
from moejax.model import layer_order
from moejax.model.mesh import BATCH_AXES, STAGE, logical_to_spec, num_stages
from moejax.model.moe import fsep_backward
from moejax.model.moe.fsep_experts import restore_layer
from moejax.model.moe.layer import MoEStats
from moejax.model.transformer import GroupCarry, Head, Transformer, remat_kwargs
from pallas_kernels import compat


def microbatch_rows(a, micro: int):
  """[B, ...] -> [M, B/M, ...]: microbatch m is the rows i with i % M == m, so that each
  device's rows of a microbatch are rows it holds (the split moves no data)."""
  return a.reshape((a.shape[0] // micro, micro) + a.shape[1:]).swapaxes(0, 1)


def _split(tree, stages: int, virtual: int):
  """Every leaf [G, ...] in storage order -> [stages, virtual, K, ...]."""
  return jax.tree.map(lambda a: a.reshape((stages, virtual, -1) + a.shape[1:]), tree)


def _canonical_split(tree, stages: int, virtual: int):
  """Every leaf [G, ...] in canonical order -> [stages, virtual, K, ...] (chunk r*P + s)."""
  def split(a):
    a = a.reshape((virtual, stages, -1) + a.shape[1:])
    return jnp.swapaxes(a, 0, 1)
  return jax.tree.map(split, tree)


def _canonical_merge(tree):
  """[stages, virtual, K, ...] -> [G, ...] in canonical order."""
  return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[3:]), tree)


def _rotate(mesh, stages: int):
  """[stages, rows, ...] -> the same with stage s holding what stage s - 1 held (stage 0 gets
  the last stage's): one collective permute over `stage`."""
  if stages == 1:
    return lambda x: x
  spec = P(STAGE, BATCH_AXES)
  pairs = [(s, (s + 1) % stages) for s in range(stages)]
  return jax.shard_map(lambda x: jax.lax.ppermute(x, STAGE, pairs), mesh=mesh,
                       in_specs=spec, out_specs=spec)


def _collect(mesh, stages: int):
  """[stages, M, rows, ...] -> stage 0's [M, rows, ...] on every stage: one all-reduce in which
  the other stages add zeros (its transpose sends nothing: the head's gradient is the same on
  every stage, and stage 0 keeps it)."""
  if stages == 1:
    return lambda loop: loop[0]

  def first(loop):
    return jax.lax.psum(jnp.where(jax.lax.axis_index(STAGE) == 0, loop[0], 0), STAGE)
  return jax.shard_map(first, mesh=mesh, in_specs=P(STAGE, None, BATCH_AXES),
                       out_specs=P(None, BATCH_AXES))


def _chunk_runner(model: Transformer, virtual: int):
  """run(stage_args, chunk, x) -> (x, stats): one stage's chunk `chunk` of K groups on x.
  `stage_args` = (layer params, fsep stored experts or None, layout rows), each [V, K, ...]."""
  cfg, moe_cfg, mesh = model.cfg, model.moe_cfg, model.mesh
  # PREFETCH's channel cannot cross the ticks: the backward restores again, or keeps
  backward = (fsep_backward.RERESTORE if compat.rerestores_fsep(num_stages(mesh) > 1) else
              fsep_backward.KEEP)
  group = model.layer_group(backward)
  fsep = moe_cfg.expert_mode == "fsep"
  dtype = jnp.dtype(cfg.dtype)

  remat = cfg.remat and not fsep    # fsep remats its dense blocks inside LayerGroup

  def one_group(carry, xs, stored):
    group_params, layout_row, layer = xs
    if remat:
      # The layer's weights pass one barrier with its input, so that what is computed from
      # them (the bf16 weights, FSDP's gather) depends on the tick: left loop-invariant, JAX's
      # scan linearization hoists it out of the tick loop (its known-value hoisting) and the
      # stage holds every one of its K layers' gathered weights at once for the whole step.
      # Inside the checkpoint, so that the residuals stay the weights as stored; without
      # remat every tick would keep its own cast weights as residuals, more than the stack.
      group_params, x_BxQxD = jax.lax.optimization_barrier((group_params, carry.x_BxQxD))
      carry = carry._replace(x_BxQxD=x_BxQxD)
    return group.apply({"params": group_params}, carry, (layout_row, layer), *stored)

  if remat:
    one_group = jax.checkpoint(one_group, **remat_kwargs(cfg))

  def run(stage_args, chunk, x):
    pick = ((lambda a: a[0]) if virtual == 1 else
            (lambda a: jax.lax.dynamic_index_in_dim(a, chunk, 0, keepdims=False)))
    params, stored, layout = jax.tree.map(pick, stage_args)
    layers = jnp.arange(jax.tree.leaves(layout)[0].shape[0])
    carry, broadcast = GroupCarry(x), ()
    if fsep:   # this chunk's experts only: the first layer now, the scan the next one a step
      table = layout.slot_expert_LxS
      carry = GroupCarry(x, restore_layer(stored, table, 0, mesh, dtype, model.fsdp))
      broadcast = ((stored, table),)
    carry, stats = jax.lax.scan(lambda c, xs: one_group(c, xs, broadcast), carry,
                                (params, layout, layers))
    return carry.x_BxQxD, stats

  return run


def pipelined_apply(model: Transformer, microbatches: int, params, tokens_BxQ: jax.Array,
                    layout: Layout, virtual: int = 1) -> tuple[Head, MoEStats]:
  """The Transformer's (head, stats) with its layer groups run as a pipeline over the
  mesh's stages, V = `virtual` chunks per stage (`params`' layer groups in
  layer_order.storage_order; `layout` and the stats in canonical order).

  The G scanned layer groups split into P stages x V chunks (V: `train.virtual_stages`; 1 for
  GPipe) of K = G/(P*V) whole groups. Chunk c = r*P + s (the r-th chunk of stage s) computes
  groups c*K .. c*K + K - 1, so with V > 1 a stage holds V non-adjacent chunks and a microbatch
  goes V times around the ring of stages. The parameters of stage s's chunks are stored
  together in the `layers` axis sharded over `stage` (moejax.model.layer_order: the identity for
  V = 1), so the split moves no data. The batch splits into M microbatches, microbatch m being
  the rows i with i % M == m, so that each device's rows of a microbatch are rows it holds.

  One schedule serves both: V*M + P - 1 ticks; at tick t stage s runs step j = t - s, i.e.
  microbatch j % M through its chunk j // M (idle, on values nobody reads, outside
  0 <= j < V*M). Each tick's one stage transfer is a rotation, one `ppermute` over `stage` (in
  `shard_map`): stage s receives what stage s - 1 computed at the tick before, and stage 0
  what the last stage finished at step t - P. Every stage keeps its own loop buffer of M
  microbatch slots (sharded over `stage`; only stage 0's is read), which starts as the
  microbatches: stage 0 stores what the rotation brings into the slot of its microbatch and runs
  slot t % M. A microbatch the last stage finishes at tick r*M + m + P - 1 arrives at stage 0 at
  r*M + m + P and is read at (r+1)*M + m, which needs M >= P when V > 1. After the last tick one
  more rotation brings the last output to stage 0, and its slots, every microbatch's last chunk,
  go to every stage's head in one all-reduce over `stage` (the other stages add zeros). With
  V = 1 this is GPipe's fill-drain (bubble (P-1)/(M+P-1)); with V > 1 each tick runs one chunk,
  1/V of a stage's layers, and the bubble is (P-1)/(V*M+P-1) of the step.

  Every stage runs the same program: the stages are one `vmap` over the stage axis whose
  `spmd_axis_name` is `stage`, so each MoE layer's `shard_map` keeps its expert parallelism over
  `expert` inside each stage. In fsep mode a stage restores only its chunk's experts, layer by
  layer as the Transformer does (the first before the chunk's scan, the next in each step;
  under FSDP on the stored weights' `data` shards, the MoE layer gathering its layer). The
  backward pass is the ticks' autodiff, which runs them in reverse.

  The Transformer's other parts, `embed` (the embedding and the dense first blocks) and
  `head` (final norm, unembedding; then the loss), are replicated over `stage` and computed
  by every stage, as SPMD makes them; only the layer groups are split. Hence the one
  collection of the outputs per step, not a head on the last stage alone: it costs one
  all-reduce of the batch's activations a step (and in the backward one more, the embedding
  output's cotangent summed over the stages' copies), against 2 (V*M + P - 1) rotations.
  """
  cfg, mesh = model.cfg, model.mesh
  stages, micro = num_stages(mesh), microbatches
  dtype = jnp.dtype(cfg.dtype)
  batch, length = tokens_BxQ.shape
  rows = batch // micro
  act = NamedSharding(mesh, logical_to_spec(("batch", "length", "embed")))
  x_BxQxD = model.apply({"params": params}, tokens_BxQ, method=Transformer.embed)
  d_model = x_BxQxD.shape[-1]
  feed = microbatch_rows(x_BxQxD, micro)   # [micro, rows, Q, D]

  run_chunk = _chunk_runner(model, virtual)
  run_stages = jax.vmap(run_chunk, spmd_axis_name=STAGE if stages > 1 else None)
  groups = Transformer.group_params(params)
  stage_args = (_split(groups.layers, stages, virtual),
                None if groups.stored is None else _split(groups.stored, stages, virtual),
                _canonical_split(layout, stages, virtual))
  rotate, collect = _rotate(mesh, stages), _collect(mesh, stages)
  stage_ids = jnp.arange(stages)
  steps = virtual * micro
  state = jnp.zeros((stages, rows, length, d_model), dtype)      # what each stage runs next
  # Each stage's own loop buffer [M, rows, Q, D]; only stage 0's is read. It starts as the
  # microbatches (every stage computed the embedding, so the copy moves nothing).
  loop_spec = NamedSharding(mesh, P(STAGE if stages > 1 else None, None, BATCH_AXES))
  loop = jax.lax.with_sharding_constraint(jnp.broadcast_to(feed, (stages,) + feed.shape),
                                          loop_spec)
  stats_shape = jax.eval_shape(run_stages, stage_args, stage_ids, state)[1]
  # per (stage, chunk): the sums over microbatches of each group's statistics
  zero_stats = jax.tree.map(lambda s: jnp.zeros(s.shape[:1] + (virtual,) + s.shape[1:], s.dtype),
                            stats_shape)

  def keep(loop, received, t):
    """Stage 0's rotated input is the last stage's output of step t - P (microbatch
    (t - P) % M): it goes to that microbatch's slot, read at tick t - P + M >= t. Before tick P
    nothing has arrived, and slot (t - P) % M still holds a microbatch not yet read."""
    back = t - stages
    slot = jnp.maximum(back, 0) % micro
    received = jnp.where(back >= 0, received, loop[:, slot])
    loop = jax.lax.dynamic_update_index_in_dim(loop, received, slot, 1)
    return jax.lax.with_sharding_constraint(loop, loop_spec)

  def tick(carry, t):
    state, loop, stats_sum = carry
    step = t - stage_ids                                              # [stages]
    busy = (step >= 0) & (step < steps)
    chunk = jnp.clip(step, 0, steps - 1) // micro
    received = rotate(state)                  # the tick's one send: stage s - 1's output
    loop = keep(loop, received, t)
    first = (stage_ids == 0)[:, None, None, None]
    state = jnp.where(first, jax.lax.dynamic_index_in_dim(loop, t % micro, 1, keepdims=False),
                      received)
    state, stats = run_stages(stage_args, chunk, state)
    where = (jax.nn.one_hot(chunk, virtual, dtype=jnp.bool_) & busy[:, None])   # [stages, V]
    stats_sum = jax.tree.map(
        lambda acc, s: acc + jnp.where(where.reshape(where.shape + (1,) * (s.ndim - 1)),
                                       s[:, None], 0),
        stats_sum, stats)
    return (state, loop, stats_sum), None

  ticks = steps + stages - 1
  (state, loop, stats_sum), _ = jax.lax.scan(tick, (state, loop, zero_stats), jnp.arange(ticks))
  # The last step's output is still on the last stage: one more rotation brings it to stage 0,
  # whose slots then hold every microbatch's last chunk; one collection hands them to the head.
  outputs = collect(keep(loop, rotate(state), ticks))
  x_BxQxD = jax.lax.with_sharding_constraint(
      outputs.transpose(1, 0, 2, 3).reshape(batch, length, d_model), act)
  head = model.apply({"params": params}, x_BxQxD, method=Transformer.head)
  stats = _canonical_merge(stats_sum)
  stats = stats._replace(balance_loss=stats.balance_loss / micro, z_loss=stats.z_loss / micro)
  return head, stats


@dataclasses.dataclass(frozen=True)
class Pipelined:
  """`model` run as a pipeline of the mesh's stages, `virtual` chunks each, over
  `microbatches` microbatches; the parameter tree of `model`, its layer groups stored in
  `layer_order` (the identity for virtual = 1)."""
  model: Transformer
  microbatches: int
  virtual: int = 1

  @property
  def mesh(self):
    return self.model.mesh

  @property
  def cfg(self):
    return self.model.cfg

  @property
  def layer_order(self) -> np.ndarray:
    """Canonical layer group of each storage row (moejax.model.layer_order)."""
    groups = num_moe_layers(self.model.cfg, self.model.moe_cfg)
    return layer_order.storage_order(groups, num_stages(self.mesh), self.virtual)

  def init(self, rng, tokens_BxQ: jax.Array, layout: Layout):
    variables = self.model.init(rng, tokens_BxQ, layout)
    return dict(variables, params=layer_order.params_to(variables["params"], self.layer_order))

  def apply(self, variables, tokens_BxQ: jax.Array, layout: Layout) -> tuple[Head, MoEStats]:
    return pipelined_apply(self.model, self.microbatches, variables["params"], tokens_BxQ,
                           layout, self.virtual)
