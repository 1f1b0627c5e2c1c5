"""TensorBoard event files: the hook's tags and values, read back from the file, match the
run's metrics.jsonl; only process 0 writes them, and only with train.tensorboard on."""

from __future__ import annotations

import glob
import io
import os

import numpy as np
import pytest

from moejax.train.tensorboard import TensorBoard, heatmap, read_events, tensorboard_hooks
from tests.run_config import read_jsonl
from tests.run_helpers import STEPS, reference_losses, shared_dir

__all__ = ["reference_losses"]   # the fixture, imported for pytest


def test_hook_writes_scalars_eval_and_heatmaps(tmp_path):
  counts_LxWxE = np.arange(2 * 4 * 3).reshape(2, 4, 3)
  record = {"loss": 2.5, "ce": 2.4, "grad_norm": 0.7, "lr": 1e-3, "tokens_per_s": None,
            "moe": [{"layer": 0, "dropped_fraction": 0.125, "max_over_mean_load": 1.5},
                    {"layer": 1, "dropped_fraction": 0.0, "max_over_mean_load": 1.0,
                     "realised_max_over_mean": 1.25}]}
  hook = TensorBoard(str(tmp_path), image_every=2)
  for step in range(3):
    hook.after_metrics(None, step, record, counts_LxWxE, 0)
  hook.after_eval(None, 2, 3.0)
  hook.close()
  events = read_events(str(tmp_path))
  scalars = {(s, t): v for s, t, v in events if isinstance(v, float)}
  assert scalars[(1, "train/loss")] == 2.5 and scalars[(2, "eval/loss")] == 3.0
  assert scalars[(0, "moe/layer0/dropped_fraction")] == 0.125
  assert scalars[(2, "moe/layer1/realised_max_over_mean")] == 1.25
  assert (0, "train/tokens_per_s") not in scalars   # None: not yet measured
  assert (0, "moe/layer0/realised_max_over_mean") not in scalars
  images = {(s, t): v for s, t, v in events if isinstance(v, bytes)}
  assert sorted(images) == [(0, "moe/layer0/expert_load"), (0, "moe/layer1/expert_load"),
                            (2, "moe/layer0/expert_load"), (2, "moe/layer1/expert_load")]
  from PIL import Image

  png = np.asarray(Image.open(io.BytesIO(images[(2, "moe/layer1/expert_load")])))
  np.testing.assert_array_equal(png, heatmap(counts_LxWxE[1]))
  assert png.shape == (4 * 8, 3 * 8, 3) and png[-1, -1].tolist() == [255, 255, 255]


@pytest.mark.slow   # over the 8-minute budget of the README test command: .ci/run's slow pass
def test_run_writes_events_beside_metrics(reference_losses):
  """The shared tiny run (tests/run_helpers.py) with the default train.tensorboard = True."""
  run_dir = shared_dir("reference_run")
  assert glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
  events = read_events(run_dir)
  tags = {t for _, t, _ in events}
  assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "eval/loss",
          "moe/layer0/dropped_fraction", "moe/layer0/routed_max_over_mean",
          "moe/layer0/realised_max_over_mean", "moe/layer0/expert_load"} <= tags
  losses = {s: v for s, t, v in events if t == "train/loss"}
  assert sorted(losses) == list(range(STEPS))
  for step, loss in reference_losses.items():   # float32 in the event file
    assert loss == pytest.approx(losses[step], rel=1e-6)
  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  eval_jsonl = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  eval_tb = [(s, v) for s, t, v in events if t == "eval/loss"]
  assert [s for s, _ in eval_tb] == [s for s, _ in eval_jsonl]
  np.testing.assert_allclose([v for _, v in eval_tb], [v for _, v in eval_jsonl], rtol=1e-6)
  images = {s for s, t, _ in events if t == "moe/layer0/expert_load"}
  assert images == set(range(0, STEPS, 10))


def test_only_process_0_and_only_when_on(tmp_path):
  hooks = tensorboard_hooks(True, True, str(tmp_path), 0)
  assert [type(h) for h in hooks] == [TensorBoard]
  hooks[0].close()   # an open writer's exit handler fails at interpreter shutdown (Python 3.12)
  assert tensorboard_hooks(False, True, str(tmp_path), 0) == []   # train.tensorboard = False
  assert tensorboard_hooks(True, False, str(tmp_path), 0) == []   # processes other than 0
