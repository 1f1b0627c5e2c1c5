"""Train state and its shardings; sharded init without allocating on one device."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.layout.tables import Layout
from moejax.model.mesh import RULES


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # float32 [MoE layers, E], expert-id order: the aux-loss-free balancing bias, updated by
  # the step from the load (not a gradient). Expert-indexed, so it follows an expert through
  # migrations and is the same under ep and fsep; the model adds it to the layout's bias.
  router_bias_LxE: jax.Array


def _init_variables(model: nn.Module, layout: Layout, batch: int, seq_len: int, seed: int):
  tokens = jnp.zeros((batch, seq_len), jnp.int32)
  return model.init(jax.random.key(seed), tokens, layout)


def state_shardings(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                    layout: Layout, batch: int, seq_len: int, rules=RULES) -> TrainState:
  """Shardings of every state leaf, from the logical axis names of the params under `rules`
  (moejax.model.mesh.param_rules: RULES, or with the FSDP / stage overrides)."""
  boxed = jax.eval_shape(lambda: _init_variables(model, layout, batch, seq_len, 0))
  param_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)["params"]
  abstract_params = nn.meta.unbox(boxed)["params"]
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  rep = NamedSharding(mesh, P())
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                 transform_non_params=lambda _: rep)
  return TrainState(step=rep, params=param_sh, opt_state=opt_sh, router_bias_LxE=rep)


def per_device_bytes(shapes: Any, shardings: Any) -> int:
  """Bytes the most loaded device holds of `shapes` (ShapeDtypeStructs or arrays) laid out
  by `shardings` (a matching tree), from each leaf's shard shape: no array is allocated."""
  total = 0
  for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
    shard = s.shard_shape(x.shape)
    total += int(np.prod(shard, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
  return total


def abstract(tree: Any, shardings: Any = None) -> Any:
  """`tree` as ShapeDtypeStructs with `shardings` (a matching tree; default: each leaf's own)."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def init_state(model: nn.Module, tx: optax.GradientTransformation, shardings: TrainState,
               layout: Layout, batch: int, seq_len: int, seed: int) -> TrainState:
  def init():
    params = nn.meta.unbox(_init_variables(model, layout, batch, seq_len, seed))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      router_bias_LxE=jnp.zeros(layout.router_bias_LxE.shape, jnp.float32))
  return jax.jit(init, out_shardings=shardings)()
