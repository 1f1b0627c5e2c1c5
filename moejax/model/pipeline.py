"""The transformer's layer groups as a pipeline over the `stage` mesh axis (GPipe).

The scanned layer groups [G, ...] split into P stages of G/P whole groups: stage s holds
groups s*G/P .. (s+1)*G/P - 1 (the `layers` parameter axis is sharded over `stage`,
moejax.model.mesh.STAGE_RULES, so the split moves no data). The batch splits into M
microbatches, microbatch m being the rows i with i % M == m, so that each device's rows of a
microbatch are rows it already holds.

The schedule is fill-drain: M + P - 1 ticks; at tick t stage s runs microbatch t - s (idle,
on values nobody reads, outside 0 <= t - s < M), then every stage's output moves to the next
stage with one `ppermute` over `stage` (in `shard_map`). Every stage runs the same program:
the stages are one `vmap` over the stage axis whose `spmd_axis_name` is `stage`, so each MoE
layer's `shard_map` keeps its expert parallelism over `expert` inside each stage. The
backward pass is the ticks' autodiff, which runs them in reverse: the drain, then the fill.

The embedding and the head (final norm, unembedding, loss) are replicated over `stage` and
computed by every stage, as SPMD makes them; only the layer groups are split.

`Pipelined` has the Transformer's `init` and `apply`, so the train and eval steps take it as
the model. Its loss is the step's loss over the whole batch with each MoE layer's balance and
z losses the mean over the microbatches (their values on the whole batch with M = 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import num_moe_layers
from moejax.layout.tables import Layout
from moejax.model.mesh import BATCH_AXES, STAGE, logical_to_spec, num_stages
from moejax.model.moe.layer import MoEStats
from moejax.model.transformer import LayerGroup, RMSNorm, Transformer


def _split(tree, stages: int):
  """Every leaf [G, ...] -> [stages, G / stages, ...]: stage s gets G/stages whole groups."""
  return jax.tree.map(lambda a: a.reshape((stages, a.shape[0] // stages) + a.shape[1:]), tree)


def _merge(tree):
  return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), tree)


def _rotate(mesh, stages: int):
  """[stages, rows, ...] -> the same with stage s holding what stage s - 1 held (stage 0 gets
  the last stage's): one collective permute over `stage`."""
  if stages == 1:
    return lambda x: x
  spec = P(STAGE, BATCH_AXES)
  pairs = [(s, (s + 1) % stages) for s in range(stages)]
  return jax.shard_map(lambda x: jax.lax.ppermute(x, STAGE, pairs), mesh=mesh,
                       in_specs=spec, out_specs=spec)


def pipelined_apply(model: Transformer, microbatches: int, params, tokens_BxQ: jax.Array,
                    layout: Layout) -> tuple[jax.Array, MoEStats]:
  """The Transformer's (logits_BxQxV, stats) with its layer groups run as a GPipe pipeline
  over the mesh's stages (one stage: the microbatches one after another)."""
  cfg, moe_cfg, mesh = model.cfg, model.moe_cfg, model.mesh
  stages, micro = num_stages(mesh), microbatches
  dtype = jnp.dtype(cfg.dtype)
  batch, length = tokens_BxQ.shape
  rows = batch // micro
  act = NamedSharding(mesh, logical_to_spec(("batch", "length", "embed")))
  x_BxQxD = jax.lax.with_sharding_constraint(params["embed"][tokens_BxQ].astype(dtype), act)
  d_model = x_BxQxD.shape[-1]
  # [micro, rows, Q, D]: microbatch m = the rows i with i % micro == m
  feed = x_BxQxD.reshape(rows, micro, length, d_model).transpose(1, 0, 2, 3)

  group = LayerGroup(cfg, moe_cfg, mesh)

  def one_group(x, xs):
    group_params, layout_row, layer = xs
    return group.apply({"params": group_params}, x, (layout_row, layer))

  if cfg.remat:
    one_group = jax.checkpoint(one_group)

  def run_stage(stage_params, stage_layout, stage_layers, x):
    return jax.lax.scan(one_group, x, (stage_params, stage_layout, stage_layers))

  run_stages = jax.vmap(run_stage, spmd_axis_name=STAGE if stages > 1 else None)
  num_groups = num_moe_layers(cfg, moe_cfg)
  stage_args = (_split(params["layers"], stages), _split(layout, stages),
                jnp.arange(num_groups).reshape(stages, -1))
  rotate = _rotate(mesh, stages)
  stage_ids = jnp.arange(stages)
  state = jnp.zeros((stages, rows, length, d_model), dtype)      # what each stage runs next
  stats_shape = jax.eval_shape(run_stages, *stage_args, state)[1]
  zero_stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape)

  def tick(carry, t):
    state, outputs, stats_sum = carry
    first = (stage_ids == 0)[:, None, None, None]
    state = jnp.where(first, feed[jnp.minimum(t, micro - 1)][None], rotate(state))
    state, stats = run_stages(*stage_args, state)
    # The last stage finishes microbatch t - (stages - 1); before the first one finishes it
    # writes slot 0, which microbatch 0 overwrites at tick stages - 1.
    done = jnp.clip(t - (stages - 1), 0, micro - 1)
    outputs = jax.lax.dynamic_update_index_in_dim(outputs, state[stages - 1], done, 0)
    busy = (t >= stage_ids) & (t - stage_ids < micro)                  # [stages]
    stats_sum = jax.tree.map(
        lambda acc, s: acc + jnp.where(busy.reshape((stages,) + (1,) * (s.ndim - 1)), s, 0),
        stats_sum, stats)
    return (state, outputs, stats_sum), None

  outputs = jnp.zeros((micro, rows, length, d_model), dtype)
  (_, outputs, stats_sum), _ = jax.lax.scan(tick, (state, outputs, zero_stats),
                                            jnp.arange(micro + stages - 1))
  x_BxQxD = jax.lax.with_sharding_constraint(
      outputs.transpose(1, 0, 2, 3).reshape(batch, length, d_model), act)
  x_BxQxD = RMSNorm(cfg.norm_eps).apply({"params": params["ln_final"]}, x_BxQxD)
  logits_BxQxV = jnp.einsum("bqd,dv->bqv", x_BxQxD.astype(jnp.float32), params["unembed"])
  stats = _merge(stats_sum)
  stats = stats._replace(balance_loss=stats.balance_loss / micro, z_loss=stats.z_loss / micro)
  return logits_BxQxV, stats


@dataclasses.dataclass(frozen=True)
class Pipelined:
  """`model` run as a pipeline of the mesh's stages over `microbatches` microbatches; the
  same parameters (and parameter tree) as `model`."""
  model: Transformer
  microbatches: int

  @property
  def mesh(self):
    return self.model.mesh

  def init(self, rng, tokens_BxQ: jax.Array, layout: Layout):
    return self.model.init(rng, tokens_BxQ, layout)

  def apply(self, variables, tokens_BxQ: jax.Array, layout: Layout):
    return pipelined_apply(self.model, self.microbatches, variables["params"], tokens_BxQ,
                           layout)
