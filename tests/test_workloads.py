"""Synthetic routing traces: shapes, sums, determinism, drift correlation, collapse, file I/O."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.placement.synthetic import load_trace, save_trace, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]


def _consecutive_corr(counts):
  load = counts.sum(2).astype(np.float64)                   # [T, L, E]
  return np.mean([np.corrcoef(load[t, i], load[t + 1, i])[0, 1]
                  for t in range(len(load) - 1) for i in range(load.shape[1])])


@pytest.mark.parametrize("kind", ["lognormal", "zipf", "collapse", "early_collapse"])
def test_shapes_dtypes_and_row_sums(kind):
  tr = synthetic_trace(7, 3, 5, 12, top_k=2, tokens_per_source=100, kind=kind, seed=1)
  c = tr["counts"]
  assert c.shape == (7, 3, 5, 12) and c.dtype == np.int64
  assert tr["top_k"] == 2
  np.testing.assert_array_equal(tr["step"], np.arange(7))
  assert np.all(c >= 0)
  assert np.all(c.sum(-1) == 2 * 100)                      # every (step, layer, source) row


def test_deterministic_by_seed():
  a = synthetic_trace(5, 2, 4, 8, seed=3)["counts"]
  b = synthetic_trace(5, 2, 4, 8, seed=3)["counts"]
  c = synthetic_trace(5, 2, 4, 8, seed=4)["counts"]
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_lognormal_consecutive_steps_correlate_about_corr():
  for seed in range(3):
    c = synthetic_trace(150, 2, 8, 32, tokens_per_source=512, corr=0.8, seed=seed)["counts"]
    assert 0.7 <= _consecutive_corr(c) <= 0.9
  # Higher `corr` gives higher correlation; the load is skewed (max/mean of expert load > 2).
  hi = synthetic_trace(150, 2, 8, 32, tokens_per_source=512, corr=0.95, seed=0)["counts"]
  assert _consecutive_corr(hi) > 0.9
  load = hi.sum(2)
  assert np.median(load.max(-1) / load.mean(-1)) > 2.0


def test_zipf_is_skewed_and_stable():
  c = synthetic_trace(60, 2, 8, 32, tokens_per_source=512, kind="zipf", seed=0)["counts"]
  share = c.sum(2) / c.sum((2, 3))[..., None]
  assert np.median(share.max(-1)) > 3 / 32
  assert _consecutive_corr(c) > 0.8


def test_collapse_shape():
  c = synthetic_trace(40, 2, 16, 32, kind="collapse", seed=0)["counts"]
  share = c.sum(2) / c.sum((2, 3))[..., None]               # [T, L, E]
  top = share.max(-1)
  assert np.all((top >= 0.3) & (top <= 0.5))
  assert np.all((share < 0.01).sum(-1) >= 16)
  # The collapsed expert stays the same within a layer.
  assert np.all(share.argmax(-1) == share[0].argmax(-1))


def test_early_collapse_starts_near_uniform_and_collapses_in_collapse_steps():
  tr = synthetic_trace(12, 2, 16, 32, kind="early_collapse", collapse_steps=3, seed=0)
  share = tr["counts"].sum(2) / tr["counts"].sum((2, 3))[..., None]   # [T, L, E]
  assert np.all(share[0].max(-1) * 32 < 1.5), "a fresh router: near-uniform"
  assert np.all(share[1].max(-1) < share[2].max(-1))
  assert np.all((share[3:].max(-1) >= 0.3) & (share[3:].max(-1) <= 0.5))
  # From collapse_steps on it is the collapse kind's gate (same seed, same draws).
  gate = synthetic_trace(12, 2, 16, 32, kind="collapse", seed=0)["counts"]
  np.testing.assert_array_equal(share[3:].argmax(-1),
                                (gate.sum(2) / gate.sum((2, 3))[..., None])[3:].argmax(-1))
  with pytest.raises(ConfigError, match="collapse_steps=0"):
    synthetic_trace(4, 1, 2, 4, kind="early_collapse", collapse_steps=0)


def test_bad_arguments():
  with pytest.raises(ConfigError, match="kind"):
    synthetic_trace(2, 1, 2, 4, kind="uniform")
  with pytest.raises(ConfigError, match="top_k"):
    synthetic_trace(2, 1, 2, 4, top_k=5)
  with pytest.raises(ConfigError, match="steps"):
    synthetic_trace(0, 1, 2, 4)


def test_save_load_round_trip(tmp_path):
  tr = synthetic_trace(4, 2, 3, 6, seed=2)
  path = tmp_path / "t.npz"
  save_trace(path, tr)
  back = load_trace(path)
  np.testing.assert_array_equal(back["counts"], tr["counts"])
  np.testing.assert_array_equal(back["step"], tr["step"])
  assert back["top_k"] == 2 and back["counts"].dtype == np.int64
  # `step` and `top_k` are optional; int32 counts are accepted.
  np.savez(tmp_path / "bare.npz", counts=tr["counts"].astype(np.int32))
  bare = load_trace(tmp_path / "bare.npz")
  np.testing.assert_array_equal(bare["step"], np.arange(4))
  assert "top_k" not in bare


def _one_line_error(path, match):
  with pytest.raises(ConfigError, match=match) as e:
    load_trace(path)
  assert "\n" not in str(e.value)


def test_load_rejects_bad_files(tmp_path):
  good = np.zeros((3, 1, 2, 4), np.int64)
  (tmp_path / "garbage.npz").write_bytes(b"not a zip file")
  _one_line_error(tmp_path / "garbage.npz", "cannot read")
  _one_line_error(tmp_path / "missing.npz", "cannot read")
  np.savez(tmp_path / "nocounts.npz", other=good)
  _one_line_error(tmp_path / "nocounts.npz", "no 'counts'")
  np.savez(tmp_path / "3d.npz", counts=good[0])
  _one_line_error(tmp_path / "3d.npz", "4-D integer")
  np.savez(tmp_path / "float.npz", counts=good.astype(np.float32))
  _one_line_error(tmp_path / "float.npz", "4-D integer")
  np.savez(tmp_path / "step.npz", counts=good, step=np.arange(5))
  _one_line_error(tmp_path / "step.npz", "step has shape")
  np.savez(tmp_path / "topk.npz", counts=good, top_k=np.array([1.5]))
  _one_line_error(tmp_path / "topk.npz", "top_k")
  np.savez(tmp_path / "neg.npz", counts=good - 1)
  _one_line_error(tmp_path / "neg.npz", "non-negative")


def test_cli_writes_trace(tmp_path):
  out = tmp_path / "cli.npz"
  subprocess.run([sys.executable, "-m", "moejax.workloads", "--out", str(out), "--kind",
                  "collapse", "--steps", "3", "--layers", "1", "--sources", "2", "--experts",
                  "8", "--seed", "5"], check=True, cwd=ROOT, capture_output=True)
  tr = load_trace(out)
  assert tr["counts"].shape == (3, 1, 2, 8) and tr["top_k"] == 2
