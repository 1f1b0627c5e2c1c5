"""The command-line front end: gin files and bindings -> the validated frozen Config.

The only module of the package that imports gin (the library proper never does);
`train.py` and `python -m moejax.plan` parse their flags through it. A `model.vocab_size`
of 0 ("the data's") is filled in here when the data names it (the byte corpus, a prepared
directory's meta.json), and by the trainer otherwise (a token file's largest id).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tokenize

import gin

from moejax import config as config_lib
from moejax.train import data as data_lib

DEFAULT_GIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "default.gin")
CONFIGURABLES = {
    "mesh": config_lib.MeshConfig, "model": config_lib.ModelConfig, "moe": config_lib.MoEConfig,
    "data": config_lib.DataConfig, "optim": config_lib.OptimConfig,
    "checkpoint": config_lib.CheckpointConfig, "train": config_lib.TrainConfig,
    "planner": config_lib.PlannerConfig, "trace": config_lib.TraceConfig,
    "strategy": config_lib.StrategyConfig,
}
_GIN_CLASSES = {name: gin.external_configurable(cls, name=name)
                for name, cls in CONFIGURABLES.items()}


def _plain(name: str, obj) -> object:
  """Re-create as the plain dataclass (no gin wrapper); gin lists become tuples."""
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in dataclasses.asdict(obj).items()}
  return CONFIGURABLES[name](**fields)


def parse_config(gin_files: list[str], gin_bindings: list[str]) -> config_lib.Config:
  """Gin files + bindings -> the validated frozen Config. Raises ConfigError (one line)."""
  for path in gin_files:
    if not os.path.exists(path):
      raise config_lib.ConfigError(f"--gin_file={path} does not exist; pass a path such as "
                                   f"{os.path.relpath(DEFAULT_GIN)}.")
  try:
    gin.clear_config()
    gin.parse_config_files_and_bindings(gin_files, gin_bindings)
    parts = {name: cls() for name, cls in _GIN_CLASSES.items()}
  # gin's unknown name / bad value errors; an unterminated string is a SyntaxError under
  # Python 3.11's tokenizer and a tokenize.TokenError under 3.12's.
  except (ValueError, TypeError, SyntaxError, tokenize.TokenError) as e:
    first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    bare = _unquoted_word(gin_files, gin_bindings) if "malformed node" in first else None
    if bare is not None:
      name, value = bare
      raise config_lib.ConfigError(
          f"{name} = {value}: gin cannot read the bare word {value}; a string needs quotes: "
          f"{name} = '{value}'.") from None
    raise config_lib.ConfigError(
        f"bad gin binding or file: {first}. Known configurables: {', '.join(CONFIGURABLES)}; "
        "see moejax/config/ for their fields.") from None
  cfg = config_lib.Config(**{name: _plain(name, obj) for name, obj in parts.items()}).validate()
  vocab = data_lib.declared_vocab(cfg.data)   # model.vocab_size = 0: the data's, known here
  return cfg if vocab is None else data_lib.resolve_vocab(cfg, vocab)


def _unquoted_word(gin_files: list[str], gin_bindings: list[str]) -> tuple[str, str] | None:
  """The first `name = word` line of the bindings or files whose value is a bare word (what
  gin fails to read with "malformed node or string"), as (name, word); None if none is."""
  lines = list(gin_bindings)
  for path in gin_files:
    with open(path) as f:
      lines += f.read().splitlines()
  for line in lines:
    m = re.fullmatch(r"\s*([\w.]+)\s*=\s*([A-Za-z_]\w*)\s*(#.*)?", line)
    if m and m.group(2) not in ("True", "False", "None"):
      return m.group(1), m.group(2)
  return None


def operative_config() -> str:
  return gin.operative_config_str()
