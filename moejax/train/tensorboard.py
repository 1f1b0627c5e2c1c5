"""TensorBoard: a trainer hook that writes each step's scalars and, every IMAGE_EVERY steps,
each MoE layer's expert-load heatmap (sources x experts) into the run dir, beside
metrics.jsonl, with tensorboardX (no TensorFlow). Process 0 only; `train.tensorboard = False`
turns it off. `read_events` reads an event file back (tests, notebooks)."""

from __future__ import annotations

import glob
import os
import struct

import numpy as np

from moejax.train.controllers import Hook

IMAGE_EVERY = 10   # heatmaps are ~KBs each; a scalar per step is bytes
CELL = 8           # pixels per (source, expert) cell, so small matrices stay visible
_SCALARS = (("loss", "train/loss"), ("ce", "train/ce"), ("grad_norm", "train/grad_norm"),
            ("lr", "train/lr"), ("tokens_per_s", "train/tokens_per_s"))
_LAYER_SCALARS = (("dropped_fraction", "dropped_fraction"),
                  ("max_over_mean_load", "routed_max_over_mean"),
                  ("realised_max_over_mean", "realised_max_over_mean"))


def heatmap(counts_WxE: np.ndarray, cell: int = CELL) -> np.ndarray:
  """uint8 [S*cell, E*cell, 3] image of a count matrix, black (0) to white (the max) through
  red and yellow."""
  x = np.asarray(counts_WxE, np.float64)
  x = x / x.max() if x.max() > 0 else x
  rgb = np.stack([np.clip(3 * x - k, 0, 1) for k in range(3)], axis=-1)
  return np.kron((rgb * 255).round().astype(np.uint8), np.ones((cell, cell, 1), np.uint8))


class TensorBoard(Hook):
  """Scalars: train/{loss, ce, grad_norm, lr, tokens_per_s}, eval/loss and per MoE layer l
  moe/layer{l}/{dropped_fraction, routed_max_over_mean, realised_max_over_mean};
  images: moe/layer{l}/expert_load. A resumed run purges the steps after its checkpoint."""

  def __init__(self, run_dir: str, start: int = 0, image_every: int = IMAGE_EVERY):
    from tensorboardX import SummaryWriter

    os.makedirs(run_dir, exist_ok=True)
    self.writer = SummaryWriter(logdir=run_dir, purge_step=start or None, flush_secs=30)
    self.image_every = image_every

  def after_metrics(self, trainer, step, record, counts_LxWxE, member) -> None:
    del trainer, member
    for key, tag in _SCALARS:
      if record.get(key) is not None:
        self.writer.add_scalar(tag, record[key], step)
    for layer in record["moe"]:
      for key, name in _LAYER_SCALARS:
        if key in layer:
          self.writer.add_scalar(f"moe/layer{layer['layer']}/{name}", layer[key], step)
    if step % self.image_every == 0:
      for layer, counts_WxE in enumerate(counts_LxWxE):
        self.writer.add_image(f"moe/layer{layer}/expert_load", heatmap(counts_WxE), step,
                              dataformats="HWC")

  def after_eval(self, trainer, step, eval_loss) -> None:
    del trainer
    self.writer.add_scalar("eval/loss", eval_loss, step)

  def close(self) -> None:
    self.writer.close()


def tensorboard_hooks(enabled: bool, is_main: bool, run_dir: str, start: int) -> list[Hook]:
  """The run's TensorBoard hook, if `train.tensorboard` and this is process 0."""
  return [TensorBoard(run_dir, start)] if enabled and is_main else []


def _records(path: str):
  """The payloads of a TFRecord file: [u64 length][u32 crc][payload][u32 crc] each."""
  with open(path, "rb") as f:
    while len(header := f.read(12)) == 12:
      (length,) = struct.unpack("<Q", header[:8])
      payload = f.read(length)
      if len(payload) < length or len(f.read(4)) < 4:
        return   # a torn last record of a killed run
      yield payload


def read_events(run_dir: str) -> list[tuple[int, str, float | bytes]]:
  """(step, tag, value) of every scalar (a float) and image (its PNG bytes) in the run dir's
  event files, in file order."""
  from tensorboardX.proto import event_pb2

  out = []
  for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
    for payload in _records(path):
      event = event_pb2.Event.FromString(payload)
      for v in event.summary.value:
        kind = v.WhichOneof("value")
        if kind == "simple_value":
          out.append((event.step, v.tag, v.simple_value))
        elif kind == "image":
          out.append((event.step, v.tag, v.image.encoded_image_string))
  return out
