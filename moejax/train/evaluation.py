"""A run dir's latest intact checkpoint evaluated: loss and perplexity over held-out (or given)
data, and what routing did over it (drops, the busiest device over the mean).

The loss is the trainer's eval loss: `step.loss_fn`'s cross-entropy (what `Program.eval_step`
returns, without the balance and z losses) on the batches the trainer's evaluation reads
(`BatchLoader.batch_at(0..)` of the split, seed `data.seed + 1` for validation), routed with
the trained router bias, in the program of the run's strategy. The same pass returns the
routing counts, summed over the batches into `metrics.moe_layer_records`, training's own
per-layer record. The checkpoint is read as a resume reads it (a damaged latest step is moved
aside and the one before used), so the caller holds the run dir's lock.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from tqdm import tqdm

from moejax.config import Config, ConfigError
from moejax.model import layer_order
from moejax.strategy.spec import from_config, parse
from moejax.train import data as data_lib, metrics as metrics_lib, step as step_lib
from moejax.train.checkpoint import Checkpointer, model_fields
from moejax.train.optim import optimizer, schedule
from moejax.train.programs import Program, build_program

__all__ = ["Evaluation", "evaluate", "restore", "split_tokens"]

SPLITS = ("val", "train")
_SUMMED = ("counts_LxWxE", "dropped_LxW", "slot_counts_LxWxS", "received_LxWxN", "overflow_LxW")


@dataclasses.dataclass
class Evaluation:
  step: int
  loss: float
  perplexity: float
  batches: int
  tokens: int
  data: str             # data.path, or "the embedded corpus"
  split: str
  strategy: str
  dropped_fraction: float     # of all (token, k) choices, over every MoE layer
  max_over_mean_load: float   # choices sent to the busiest device over the mean, worst layer
  realised_max_over_mean: float   # rows the busiest device computed, over the mean, worst layer
  layers: list[dict]          # training's per-layer record, over all the batches
  warnings: list[str]

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def split_tokens(cfg: Config, split: str) -> np.ndarray:
  """The tokens of `split` of cfg.data, read as training reads them; the data's vocabulary
  must be the model's (one line otherwise)."""
  if split not in SPLITS:
    raise ConfigError(f"split {split!r} is not one of {SPLITS}.")
  data_lib.byte_corpus_mismatch(cfg)   # a converted model on the byte corpus: one line
  train, val, vocab = data_lib.load_tokens(cfg.data)
  model_vocab = cfg.model.vocab_size
  prepared = cfg.data.path is not None and os.path.isdir(cfg.data.path)
  if vocab > model_vocab or (prepared and vocab != model_vocab):
    where = cfg.data.path or "the embedded corpus"
    raise ConfigError(f"the data {where!r} has vocab_size={vocab} but the run's model has "
                      f"model.vocab_size={model_vocab}; give data prepared with the run's "
                      "tokenizer (python -m moejax.prepare_data --tokenizer ...).")
  return val if split == "val" else train


def _program(cfg: Config, devices):
  """The run's strategy (its pool's first member, in whose form checkpoints are saved),
  built without compiling the train step."""
  strategy = parse(cfg.strategy.pool[0]) if cfg.strategy.pool else from_config(cfg, len(devices))
  if strategy.num_devices != len(devices):
    raise ConfigError(f"the run's strategy {strategy.spec} uses {strategy.num_devices} devices "
                      f"but there are {len(devices)}; give a mesh that fits (--mesh).")
  horizon = max(cfg.optim.decay_steps, cfg.train.num_steps, 1)   # shapes only: never applied
  tx = optimizer(cfg.optim, horizon)
  return build_program(cfg, strategy, tx, schedule(cfg.optim, horizon), devices,
                       compile_now=False), tx


def restore(cfg: Config, run_dir: str, devices) -> tuple[Program, object, object, int, list[str]]:
  """(program, state, layout, step, warnings) of `run_dir`'s latest intact checkpoint in the
  run's strategy on `devices`: a trained state, or the weights `python -m moejax.convert
  from_hf` wrote (then no optimizer state). The state's layer groups are in the canonical
  order checkpoints hold (`prog.layer_order` gives the program's)."""
  prog, tx = _program(cfg, devices)
  if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
    raise ConfigError(f"{run_dir} holds no checkpoint yet (checkpoint.every="
                      f"{cfg.checkpoint.every}); try again once the run has saved one.")
  ckpt = Checkpointer(run_dir, cfg.checkpoint)
  try:
    ckpt.check_model(model_fields(cfg))
    meta = ckpt.latest_meta() or {}
    like = prog.abstract_state(tx)
    if "converted_from" in meta:   # weights only: no optimizer state was saved
      like = like.replace(opt_state=None)
    restored = ckpt.restore(like, prog.layout, prog.expert_mode)
  finally:
    ckpt.close()
  if restored is None:
    raise ConfigError(f"{run_dir} holds no checkpoint yet (checkpoint.every={cfg.checkpoint.every}"
                      "); try again once the run has saved one.")
  return prog, restored.state, restored.layout, restored.step, restored.warnings


def evaluate(cfg: Config, run_dir: str, tokens: np.ndarray, batches: int = 0, split: str = "val",
             devices=None, progress: bool = False) -> Evaluation:
  """`run_dir`'s latest intact checkpoint on `tokens` (`split_tokens`): the first `batches`
  batches the trainer's evaluation reads (0: every whole batch of the split, each window
  once)."""
  devices = list(jax.devices() if devices is None else devices)
  prog, state, layout, step, warnings = restore(cfg, run_dir, devices)
  state = layer_order.reorder_state(state, prog.layer_order)
  seed = cfg.data.seed + (1 if split == "val" else 0)   # the trainer's val_loader's
  rows = data_lib.process_rows(prog.batch_sharding, cfg.data.global_batch_size,
                               cfg.data.seq_len + 1)
  loader = data_lib.BatchLoader(tokens, seq_len=cfg.data.seq_len,
                                global_batch_size=cfg.data.global_batch_size, seed=seed,
                                process_index=jax.process_index(),
                                process_count=jax.process_count(), rows=rows)
  count = batches or loader.batches_per_epoch
  if not 1 <= count <= loader.batches_per_epoch:
    raise ConfigError(f"--batches={batches}: the {split} split has {loader.batches_per_epoch} "
                      "whole batches; give 1 to that many (0: all of them, each window once).")
  # The eval step's own function (step.loss_fn), here keeping the routing counts it computes.
  forward = jax.jit(lambda params, batch, lay: step_lib.loss_fn(params, prog.model, prog.cfg.moe,
                                                                batch, lay)[1],
                    in_shardings=(prog.shardings.params, prog.batch_sharding,
                                  prog.layout_sharding))
  routed = step_lib.biased_layout(jax.device_put(layout, prog.layout_sharding),
                                  state.router_bias_LxE)   # routes as trained
  losses, sums, per_layer = [], {}, {}
  for i in tqdm(range(count), disable=not progress, desc="evaluate", leave=False):
    batch = data_lib.make_global_batch(loader.batch_at(i), prog.batch_sharding,
                                       cfg.data.global_batch_size)
    aux = jax.device_get(forward(state.params, batch, routed))
    losses.append(float(aux["ce"]))
    for name in _SUMMED:
      sums[name] = sums.get(name, 0) + np.asarray(aux[name], np.int64)
    for name in ("balance_loss_L", "z_loss_L"):
      per_layer.setdefault(name, []).append(np.asarray(aux[name], np.float64))
  sums.update({name: np.mean(v, axis=0) for name, v in per_layer.items()})
  layers = metrics_lib.moe_layer_records(sums, prog.mesh.shape["expert"])
  choices = float(np.sum(sums["counts_LxWxE"]))
  loss = float(np.mean(losses))
  return Evaluation(
      step=step, loss=loss, perplexity=math.exp(min(loss, 700.0)), batches=count,
      tokens=count * cfg.data.global_batch_size * cfg.data.seq_len,
      data=cfg.data.path or "the embedded corpus", split=split, strategy=prog.strategy.spec,
      dropped_fraction=float(np.sum(sums["dropped_LxW"])) / max(choices, 1.0),
      max_over_mean_load=max((r["max_over_mean_load"] for r in layers), default=1.0),
      realised_max_over_mean=max((r.get("realised_max_over_mean", 1.0) for r in layers),
                                 default=1.0),
      layers=layers, warnings=warnings)
