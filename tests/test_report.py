"""moejax.report: splitting metrics.jsonl and writing valid PNGs (needs matplotlib)."""

import json

import pytest

pytest.importorskip("matplotlib")

from moejax import report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYERS, EXPERTS, SOURCES, DEVICES = 2, 4, 2, 2


def _step_record(step: int, loss: float) -> dict:
  moe = []
  for layer in range(LAYERS):
    counts = [[(step + layer + e * (s + 1)) % 7 + 1 for e in range(EXPERTS)]
              for s in range(SOURCES)]
    load = [sum(counts[0][:2]) + sum(counts[1][:2]), sum(counts[0][2:]) + sum(counts[1][2:])]
    moe.append({
        "layer": layer, "expert_counts": [sum(col) for col in zip(*counts)],
        "counts_by_source": counts, "device_load": load,
        "max_over_mean_load": max(load) / (sum(load) / DEVICES),
        "dropped_fraction": 0.01 * layer, "balance_loss": 1.0, "z_loss": 0.1,
    })
  return {"step": step, "loss": loss, "ce": loss - 0.01, "grad_norm": 1.0, "lr": 1e-3,
          "tokens_per_s": None if step == 0 else 1000.0, "moe": moe}


def _write_run(run_dir) -> None:
  lines = [json.dumps(_step_record(s, 5.0 - 0.1 * s)) for s in range(5)]
  lines.insert(2, '{"step": 9, "loss": ')   # a torn / corrupt line
  lines.append(json.dumps({"step": 2, "event": "layout_switch", "layer": 1, "policy": "greedy",
                           "predicted_gain": 0.2, "migration_s": 0.01, "experts_moved": 2}))
  lines.append(json.dumps({"step": 4, "eval_loss": 4.7}))
  lines.append(json.dumps(_step_record(3, 1.5)))   # step 3 again: this one wins
  lines.append("")
  (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _write_replay(path) -> None:
  policies = {name: {"median": 1.1 + i, "p90": 1.3 + i, "mean": 1.15 + i,
                     "series": [[1.0 + i + 0.01 * s, 1.2 + i] for s in range(6)]}
              for i, name in enumerate(["static", "greedy"])}
  path.write_text(json.dumps({"trace": "run/metrics.jsonl", "devices": DEVICES, "slots": 2,
                              "policies": policies}))


def test_load_metrics_splits_and_keeps_last(tmp_path):
  _write_run(tmp_path)
  metrics = report.load_metrics(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in metrics["steps"]] == [0, 1, 2, 3, 4]
  assert metrics["steps"][3]["loss"] == 1.5
  assert [r["eval_loss"] for r in metrics["evals"]] == [4.7]
  assert [(r["step"], r["layer"], r["policy"]) for r in metrics["switches"]] == [(2, 1, "greedy")]


@pytest.mark.slow   # 9 s of matplotlib; test_main_out_dir keeps the CLI in the fast set
def test_main_writes_pngs(tmp_path, capsys):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  _write_run(run_dir)
  replay = tmp_path / "replay_small.json"
  _write_replay(replay)
  assert report.main([str(run_dir), "--replay", str(replay)]) == 0
  names = ["expert_load_layer0.png", "expert_load_layer1.png", "device_load.png", "loss.png",
           "replay_replay_small.png"]
  for name in names:
    data = (run_dir / "plots" / name).read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC), name
  printed = capsys.readouterr().out.split()
  assert sorted(printed) == sorted(str(run_dir / "plots" / n) for n in names)


def test_main_out_dir(tmp_path):
  _write_run(tmp_path)
  out = tmp_path / "elsewhere"
  assert report.main([str(tmp_path), "--out", str(out)]) == 0
  assert (out / "loss.png").read_bytes().startswith(PNG_MAGIC)
  assert not (tmp_path / "plots").exists()
