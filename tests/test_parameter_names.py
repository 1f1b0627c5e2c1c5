"""Nothing outside moejax/model reads a model parameter by its name: the pipeline, the loss and
the step take the Transformer's parts (`embed`, `groups`, `head`) and its `Head`, so a renamed
or restructured parameter breaks nothing outside the model package.

The names are the model's own: every key of the Transformer's parameter tree, built (shapes
only) in the configurations that add modules. The check reads every file under moejax/ and
benchmarks/ outside moejax/model for a subscript, `.get`, `.pop` or `.setdefault` with one of
them as a string constant."""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.layout.leaves import EXPERT_WEIGHTS
from moejax.model.mesh import mesh_of_shape
from moejax.model.transformer import Transformer
from moejax.train.programs import initial_layout
from tests.helpers import TINY_MODEL, TINY_MOE

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The MoE layer's functional parameters: `moe_apply` takes them as a dict by these names (its
# interface, like a function's keyword arguments), and benchmarks build that dict.
LAYER_INTERFACE = {"router", *EXPERT_WEIGHTS}
# Names the step's records and result rows use too (a record's "moe" list, a row's "layers"):
# a subscript by one of these counts only when chained with another parameter name or when
# what it indexes is named for parameters (params, state.params, variables["params"]).
SHARED_WITH_RECORDS = {"moe", "layers"}
# Storage, not compute: where each expert mode keeps expert weights (layout/leaves.py, the one
# home of those paths) and their moves between ep's and fsep's paths in checkpoints and
# optimizer moments (layout/canonical.py), below the model in the layering so that a checkpoint
# converts without building one.
STORAGE = ("moejax/layout/",)
INDEXING_METHODS = ("get", "pop", "setdefault")


@functools.cache
def model_parameter_names() -> frozenset[str]:
  names = set()
  mesh = mesh_of_shape((1, 1, 1))
  model = dataclasses.replace(TINY_MODEL, num_layers=5, qk_norm="head")
  ep = dataclasses.replace(TINY_MOE, first_dense=1, num_shared_experts=1)
  for moe in (ep, dataclasses.replace(ep, expert_mode="fsep"),
              dataclasses.replace(ep, dense_equivalent=True)):
    transformer = Transformer(model, moe, mesh)
    layout = initial_layout(moe, 2, 1)
    shapes = jax.eval_shape(lambda t, m=transformer, lay=layout: m.init(jax.random.key(0), t, lay),
                            jax.ShapeDtypeStruct((1, 4), jnp.int32))
    for path, _ in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(shapes)["params"]):
      names.update(k.key for k in path)
  return frozenset(names)


def _key(node: ast.AST) -> str | None:
  """The string `node` indexes by, if any (x["k"], x.get("k", ...), x.pop("k"), x[f"k_{i}"]),
  a block's number written 0 (first_attn_3 and f"first_attn_{i}" both read first_attn_0)."""
  if isinstance(node, ast.Subscript):
    key = node.slice
  elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and
        node.func.attr in INDEXING_METHODS and node.args):
    key = node.args[0]
  else:
    return None
  if isinstance(key, ast.JoinedStr):
    text = "".join(v.value if isinstance(v, ast.Constant) else "0" for v in key.values)
  elif isinstance(key, ast.Constant) and isinstance(key.value, str):
    text = key.value
  else:
    return None
  return re.sub(r"_\d+$", "_0", text)


def _indexed(node: ast.AST) -> ast.AST | None:
  """The expression `node` indexes into."""
  if isinstance(node, ast.Subscript):
    return node.value
  if isinstance(node, ast.Call):
    return node.func.value
  return None


def parameter_reads(source: str, names: frozenset[str]) -> list[str]:
  """`line: expression` of every read of a model parameter by name in `source`."""
  tree = ast.parse(source)
  parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

  def chained(node):
    """Indexes into, or is indexed by (directly or through `.get`), another parameter name,
    or indexes something named for parameters."""
    inner, outer = _indexed(node), parents.get(node)
    if isinstance(outer, ast.Attribute):        # node.get("k")
      outer = parents.get(outer)
    return ("param" in ast.unparse(inner) or
            any(n is not None and _key(n) in names for n in (inner, outer)))

  found = [node for node in ast.walk(tree)
           if (key := _key(node)) in names and (key not in SHARED_WITH_RECORDS or chained(node))]
  return [f"{n.lineno}: {ast.unparse(n)}" for n in sorted(found, key=lambda n: n.lineno)]


def test_the_names_come_from_the_model():
  names = model_parameter_names()
  assert {"embed", "unembed", "ln_final", "layers", "fsep_experts", "first_attn_0", "moe",
          "shared", "moe_dense", "attn_moe", "q_norm", "scale"} <= names, sorted(names)


def test_the_check_finds_reads_by_name():
  names = model_parameter_names() - LAYER_INTERFACE
  source = ('w = params["unembed"]\nh = p.get("ln_final")\nm = params["layers"]["moe"]\n'
            'e = state.params["layers"].get("moe")\nrows = record["moe"]\nn = r["layers"]\n'
            'k = d[name]\na = params[f"first_attn_{i}"]\nb = params["first_mlp_2"]\n'
            'g = variables["params"]["layers"]\n')
  lines = [f.split(":")[0] for f in parameter_reads(source, names)]
  assert lines == ["1", "2", "3", "3", "4", "4", "8", "9", "10"], lines


def test_no_file_outside_the_model_reads_a_parameter_by_name():
  names = model_parameter_names() - LAYER_INTERFACE
  files = [p for d in ("moejax", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
  reads = {}
  for path in files:
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith("moejax/model/") or rel.startswith(STORAGE):
      continue
    if found := parameter_reads(path.read_text(), names):
      reads[rel] = found
  assert len(files) > 100
  assert not reads, ("files outside moejax/model read model parameters by name (take the "
                     f"Transformer's parts or its Head instead): {reads}")
