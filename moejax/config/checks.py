"""The checks every config section shares: the one-line `ConfigError`, field types as gin
gives them, batch and microbatch divisibility, and the ranges no section checks itself."""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
  """A user-facing configuration error: one line naming the value and the fix."""


# Field annotation (a string: postponed annotations) -> accepted types.
_FIELD_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
                "str | None": (str, type(None))}


def check_field_types(name: str, obj) -> None:
  """Gin accepts any literal; reject e.g. `model.d_model = 'abc'` with one line."""
  for field in dataclasses.fields(obj):
    allowed = _FIELD_TYPES.get(field.type)
    value = getattr(obj, field.name)
    if allowed and (not isinstance(value, allowed) or
                    (isinstance(value, bool) and bool not in allowed)):
      raise ConfigError(
          f"{name}.{field.name}={value!r} has type {type(value).__name__} but must be "
          f"{field.type}; e.g. {name}.{field.name} = {field.default!r}.")


def batch_split_error(batch: int, shards: int, name: str = "batch") -> str | None:
  """Why `batch` rows cannot be split evenly over `shards` = data*expert devices (None: they
  can); the one home of the rule for the trainer, the strategy space and the MoE layer."""
  if batch % shards:
    return (f"{name}={batch} is not divisible by data*expert={shards} devices; "
            f"use a multiple of {shards}")
  return None


def microbatch_split_error(batch: int, microbatches: int, shards: int) -> str | None:
  """Why batch / microbatches rows cannot split over `shards` = data*expert devices (None: can)."""
  rows = batch // microbatches
  if rows % shards:
    return (f"train.microbatches={microbatches} leaves {rows} rows per microbatch of "
            f"data.global_batch_size={batch}, not divisible by data*expert={shards} devices; "
            f"use a global batch that is a multiple of {microbatches * shards}")
  return None


# Fields whose range no other check covers: {field: the range in words}, the tests below.
_RANGES = {"mesh.host_device_count": ">= 1", "data.seq_len": ">= 1", "optim.b1": "in [0, 1)",
           "data.global_batch_size": ">= 1", "optim.learning_rate": "> 0", "optim.b2": "in [0, 1)",
           "optim.warmup_steps": ">= 0", "optim.decay_steps": ">= 0", "train.eval_every": ">= 1",
           "optim.weight_decay": ">= 0", "optim.grad_clip_norm": "> 0", "train.num_steps": ">= 0",
           "optim.min_lr_ratio": "in [0, 1]", "checkpoint.keep": ">= 1", "checkpoint.every": ">= 1",
           "train.eval_batches": ">= 1", "train.max_consecutive_nonfinite": ">= 1"}
_TESTS = {">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, "> 0": lambda v: v > 0,
          "in [0, 1]": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1}


def check_ranges(cfg) -> None:
  """`cfg` (a Config) against _RANGES: one line naming the first field out of its range."""
  for key, need in _RANGES.items():
    part, name = key.split(".")
    if not _TESTS[need](value := getattr(getattr(cfg, part), name)):
      default = getattr(type(getattr(cfg, part)), name)
      raise ConfigError(f"{key}={value} must be {need}; use e.g. {key} = {default}.")
