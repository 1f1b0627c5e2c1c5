"""MaxText's MoE layer (`maxtext.layers.moe.RoutedMoE`) for `benchmarks.peer.peer_maxtext`: how to
install it, its paths, and each path built with our weights and compiled.

Install (optional; Python >= 3.12 and jax >= 0.11.1, which tokamax requires). MaxText's wheel
declares every dependency under extras (its cuda12 extra pins about 1000 packages), so it goes
in with --no-deps, plus what `from maxtext.layers import moe` and `maxtext.configs.pyconfig`
import, found by importing until nothing was missing:

  pip install --no-deps maxtext==0.2.5 aqtp==0.9.0 qwix==0.1.8 tokamax==0.0.17 \\
      pathwaysutils==0.1.13 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 \\
      pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \\
      opentelemetry-api==1.45.2 uvicorn==0.54.0 immutabledict==4.3.1 einshape==1.0 \\
      omegaconf==2.4.0 grain==0.2.18 portpicker==1.6.0 array-record==0.8.6 drjax==0.2.1 \\
      jinja2 markupsafe requests urllib3 certifi idna click jaxtyping wadler-lindig regex \\
      safetensors 'transformers>=5.17' huggingface-hub httpx httpcore filelock cloudpickle \\
      pyyaml annotated-doc anyio h11

moejax's own dependencies (jax 0.11, flax, orbax, tensorboardX, ...) are taken as there. The
GPU image already holds the second group (its transformers 5.17.0 works). tokamax imports
xprof (a 32 MB wheel, which would also pull fire and termcolor) only for its profiling
benchmark helper; without xprof an empty module stands in for it (`_stub_xprof`), so a GPU
machine without network needs the first group only: 20 wheels, 25.6 MB.
`python -m benchmarks.peer.peer_maxtext --print_wheels DIR` prints the pip command that downloads
them for CPython 3.12 on manylinux x86_64, and the one that installs them.

The layer's config is built as MaxText's own tests build it: `pyconfig.initialize` over its
base.yml, with the fields RoutedMoE reads set to our layer's shape and options
(`maxtext_config`); the mesh from its `create_device_mesh`, its logical axis rules for the
weights' and tokens' shardings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import os
import sys
import time
import types

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.model.moe import ragged

MAXTEXT_VERSION = "0.2.5"
# The wheels a GPU machine without network needs (its image holds GPU_IMAGE_HAS).
PEER_WHEELS = (
    "maxtext==0.2.5", "aqtp==0.9.0", "qwix==0.1.8", "tokamax==0.0.17",
    "pathwaysutils==0.1.13", "fastapi==0.165.0", "starlette==1.10.0", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "typing-inspection==0.4.5", "annotated-types==0.8.0",
    "opentelemetry-api==1.45.2", "uvicorn==0.54.0", "immutabledict==4.3.1", "einshape==1.0",
    "omegaconf==2.4.0", "grain==0.2.18", "portpicker==1.6.0", "array-record==0.8.6",
    "drjax==0.2.1",
)
PEER_WHEELS_BYTES = 25_616_841      # their total, measured when the list was pinned
GPU_IMAGE_HAS = (
    "jinja2", "markupsafe", "requests", "urllib3", "certifi", "idna", "click", "jaxtyping",
    "wadler-lindig", "regex", "safetensors", "transformers>=5.17", "huggingface-hub", "httpx",
    "httpcore", "filelock", "cloudpickle", "pyyaml", "annotated-doc", "anyio", "h11",
)
# grain's wheel is tagged manylinux_2_24/2_28, the other compiled ones manylinux2014 (2_17).
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                   "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# MaxText's paths: its config overrides and the drop class each is compared within (its sparse
# paths never read capacity_factor; -1, base.yml's value, says so in the row).
PEER_PATHS = {
    "maxtext/dense_capacity": ({"sparse_matmul": False, "megablox": False}, "capacity"),
    "maxtext/dense_dropless": ({"sparse_matmul": False, "megablox": False,
                                "capacity_factor": -1.0}, "dropless"),
    "maxtext/ragged_dot": ({"sparse_matmul": True, "megablox": False,
                            "use_tokamax_gmm": False, "capacity_factor": -1.0}, "dropless"),
    "maxtext/megablox": ({"sparse_matmul": True, "megablox": True,
                          "use_tokamax_gmm": False, "capacity_factor": -1.0}, "dropless"),
    "maxtext/tokamax": ({"sparse_matmul": True, "megablox": False,
                         "use_tokamax_gmm": True, "capacity_factor": -1.0}, "dropless"),
}
# Paths MaxText runs through a Pallas interpreter off TPU: seconds a call at the tiny shape,
# many minutes at the others, and no GPU path; run only at the tiny shape or when named.
INTERPRETED = {"maxtext/megablox": "MaxText runs its Pallas TPU grouped matmul in interpret "
                                   "mode off TPU (not a GPU path); run it with --tiny or "
                                   "--paths maxtext/megablox"}


def download_command(dest: str) -> str:
  """pip download of PEER_WHEELS for CPython 3.12 on manylinux x86_64, without their deps."""
  plats = " ".join(f"--platform {p}" for p in WHEEL_PLATFORMS)
  return (f"pip download --no-deps --only-binary=:all: --python-version 3.12 "
          f"--implementation cp {plats} -d {dest} " + " ".join(PEER_WHEELS))


def install_command(wheel_dir: str) -> str:
  return f"pip install --no-deps --no-index {wheel_dir}/*.whl"


@dataclasses.dataclass
class Path:
  """One layer path on one mesh, compiled: `fwd(*args[:-1])` -> (y, aux loss, dropped),
  `fwd_bwd(*args)` -> ((loss, (y, dropped)), grads); `error` instead when it did not build."""
  name: str
  side: str                   # "moejax" or "maxtext"
  drops: str                  # "dropless" or "capacity": the class it is compared within
  options: dict
  fwd: object = None
  fwd_bwd: object = None
  args: tuple = ()
  error: str | None = None
  extra: dict = dataclasses.field(default_factory=dict)


def one_line(e: Exception) -> str:
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


@contextlib.contextmanager
def emulated_collective(on: bool):
  """On CPU, jax.lax.ragged_all_to_all (which MaxText calls) and moejax's binding of it both
  become moejax's all_to_all emulation while programs are traced: XLA:CPU lacks the op."""
  if not on:
    yield
    return
  saved = (jax.lax.ragged_all_to_all, ragged.ragged_all_to_all, ragged.check_platform)
  jax.lax.ragged_all_to_all = ragged.emulated_ragged_all_to_all
  ragged.ragged_all_to_all = ragged.emulated_ragged_all_to_all
  ragged.check_platform = lambda platform: None
  try:
    yield
  finally:
    jax.lax.ragged_all_to_all, ragged.ragged_all_to_all, ragged.check_platform = saved


def _stub_xprof() -> None:
  """tokamax imports xprof.cli.tools.get_kernel_stats_tool at import time, for its profiling
  benchmark helper only (never called here); without xprof installed an empty module stands
  in for it, which spares a 32 MB wheel."""
  if "xprof" in sys.modules or importlib.util.find_spec("xprof") is not None:
    return
  names = ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool")
  mods = []
  for name in names:   # with a spec, so that later find_spec calls on them answer
    mods.append(sys.modules.setdefault(name, types.ModuleType(name)))
    mods[-1].__spec__ = importlib.machinery.ModuleSpec(name, None)
  for parent, child, name in zip(mods, mods[1:], names[1:]):
    setattr(parent, name.rsplit(".", 1)[1], child)


def import_peer():
  """(modules, None), or (None, why) when MaxText cannot be imported here."""
  if sys.version_info < (3, 12):
    return None, (f"MaxText {MAXTEXT_VERSION} needs Python >= 3.12; this is "
                  f"{sys.version.split()[0]}")
  try:
    _stub_xprof()
    import flax.linen as nn
    from flax import nnx
    from flax.linen import partitioning
    from maxtext.configs import pyconfig
    from maxtext.layers import moe
    from maxtext.layers.initializers import nd_dense_init
    from maxtext.utils import maxtext_utils
  except Exception as e:  # noqa: BLE001  (any import failure means: no MaxText rows)
    return None, "maxtext not importable: " + one_line(e)
  return types.SimpleNamespace(nn=nn, nnx=nnx, partitioning=partitioning, pyconfig=pyconfig,
                               moe=moe, nd_dense_init=nd_dense_init,
                               maxtext_utils=maxtext_utils), None


def maxtext_config(mt, cfg, devices: int, tokens: int, platform: str, overrides: dict,
                   out_dir: str):
  """MaxText's config for our layer's shape (`cfg`: the trainer's Config): one sequence of
  `tokens` per device, experts over `devices`, float32 gate logits, our balance weight."""
  base = os.path.join(os.path.dirname(mt.pyconfig.__file__), "base.yml")
  kw = {"capacity_factor": cfg.moe.capacity_factor, **overrides}
  return mt.pyconfig.initialize(
      [None, base], run_name="peer_maxtext", enable_checkpointing=False, log_config=False,
      base_output_directory=out_dir, jax_cache_dir="", skip_jax_distributed_system=True,
      hardware="cpu" if platform == "cpu" else "gpu", dtype=str(jnp.dtype(cfg.model.dtype)),
      weight_dtype="float32", float32_gate_logits=True,
      num_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
      base_emb_dim=cfg.model.d_model, base_moe_mlp_dim=cfg.moe.d_ff,
      base_mlp_dim=cfg.moe.d_ff, base_num_decoder_layers=1,
      per_device_batch_size=1, max_target_length=tokens,
      ici_expert_parallelism=devices, ici_fsdp_parallelism=1,
      load_balance_loss_weight=cfg.moe.balance_loss_weight, **kw)


def maxtext_paths(mt, cfg, devices: int, params_h, x_h, ct_h, platform: str,
                  names: list[str], skip: dict, out_dir: str) -> list[Path]:
  """MaxText's paths `names` on a mesh of `devices`, with our weights (`params_h`: router
  [D, E], w_gate / w_up [E, D, F], w_down [E, F, D]) and tokens; those in `skip` are
  recorded as not run."""
  paths, placed = [], None
  for name in names:
    overrides, drops = PEER_PATHS[name]
    path = Path(name, "maxtext", drops, dict(overrides))
    paths.append(path)
    if name in skip:
      path.error = "not run: " + skip[name]
      continue
    try:
      placed = _build(mt, cfg, devices, params_h, x_h, ct_h, platform, path, placed, out_dir)
    except Exception as e:  # noqa: BLE001  (recorded in the row)
      path.error = one_line(e)
  return paths


def _build(mt, cfg, devices, params_h, x_h, ct_h, platform, path, placed, out_dir):
  nn, nnx = mt.nn, mt.nnx
  mcfg = maxtext_config(mt, cfg, devices, x_h.shape[1], platform, path.options, out_dir)
  path.options["capacity_factor"] = mcfg.capacity_factor
  grid = mt.maxtext_utils.create_device_mesh(mcfg, jax.devices()[:devices])
  mesh, rules = jax.sharding.Mesh(grid, mcfg.mesh_axes), mcfg.logical_axis_rules
  with mt.partitioning.axis_rules(rules), jax.set_mesh(mesh):
    layer = mt.moe.RoutedMoE(
        config=mcfg, num_experts=mcfg.num_experts, num_experts_per_tok=mcfg.num_experts_per_tok,
        mesh=mesh, kernel_init=mt.nd_dense_init(1.0, "fan_in", "truncated_normal"),
        kernel_axes=("embed", "mlp"), intermediate_dim=cfg.moe.d_ff, dtype=mcfg.dtype,
        weight_dtype=mcfg.weight_dtype, rngs=nnx.Rngs(params=0))
    graph, params, rest = nnx.split(layer, nnx.Param, ...)
    if placed is None:   # one placed copy of the weights and tokens serves every path
      params.replace_by_pure_dict({"gate": {"kernel": params_h["router"]},
                                   **{theirs: params_h[ours]
                                      for ours, theirs in MAXTEXT_EXPERT_NAMES.items()}})
      shardings = nn.logical_to_mesh_sharding(nnx.get_partition_spec(params), mesh, rules)
      act = nn.logical_to_mesh_sharding(
          P("activation_batch", "activation_length", "activation_embed"), mesh, rules)
      placed = (jax.device_put(params, shardings), jax.device_put(x_h, act),
                jax.device_put(ct_h, act))
    params, x, ct = placed
    rest = jax.device_put(rest, NamedSharding(mesh, P()))

    def fwd(params, rest, x):
      y, lb, _ = nnx.merge(graph, params, rest)(x)
      return y, (0.0 if lb is None else lb), jnp.zeros((), jnp.int32)

    def loss(params, rest, x, ct):
      y, aux, dropped = fwd(params, rest, x)
      return jnp.sum(y.astype(jnp.float32) * ct) + aux, (y, dropped)

    with emulated_collective(platform == "cpu"):
      t0 = time.perf_counter()
      path.fwd = jax.jit(fwd).lower(params, rest, x).compile()
      path.fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)).lower(
          params, rest, x, ct).compile()
      path.extra["compile_s"] = time.perf_counter() - t0
    path.args = (params, rest, x, ct)
    if path.drops == "capacity":
      path.extra["dropped"] = capacity_drops(nnx, graph, params, rest, x)
  return placed


def capacity_drops(nnx, graph, params, rest, x) -> int:
  """Choices MaxText's capacity path drops on these tokens, by its own routing and masks."""
  @jax.jit
  def count(params, rest, x):
    layer = nnx.merge(graph, params, rest)
    logits, pre_bias = layer.gate(x.astype(layer.config.dtype))
    weights_k, experts_k = layer.get_topk(logits, pre_bias)
    weights = layer.reshape_and_update_weights(weights_k, experts_k)
    dispatch, _ = layer.generate_masks(experts_k, weights)
    return experts_k.size - jnp.sum(dispatch.astype(jnp.int32))
  return int(count(params, rest, x))


# our expert weights -> MaxText's names for them
MAXTEXT_EXPERT_NAMES = {"w_gate": "wi_0", "w_up": "wi_1", "w_down": "wo"}


def expert_grads(grads) -> dict:
  """MaxText's expert-weight gradients under our names."""
  return {ours: grads[0][theirs][...] for ours, theirs in MAXTEXT_EXPERT_NAMES.items()}
