"""Every command's `--help`: a description and a help text for every flag, each ending in a
full sentence; the usage names the command as it is typed."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from moejax import calibrate, evaluate, generate, launch, plan, replay, report
from moejax.convert import __main__ as convert
from moejax.prepare_data import __main__ as prepare_data

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

import train  # noqa: E402  (the CLI module at the repo root)

COMMANDS = {"python train.py": train, "python -m moejax.plan": plan,
            "python -m moejax.report": report, "python -m moejax.replay": replay,
            "python -m moejax.launch": launch, "python -m moejax.calibrate": calibrate,
            "python -m moejax.prepare_data": prepare_data, "python -m moejax.convert": convert,
            "python -m moejax.evaluate": evaluate, "python -m moejax.generate": generate}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_help_text_is_a_full_sentence(command):
  parser = COMMANDS[command].parser()
  assert parser.prog == command
  parsers = [parser]   # and each subcommand's (python -m moejax.convert from_hf, to_hf)
  while parsers:
    parser = parsers.pop()
    assert parser.description and parser.description.endswith("."), parser.description
    for action in parser._actions:
      if isinstance(action, argparse._HelpAction):
        continue
      if isinstance(action, argparse._SubParsersAction):
        for name, sub in action.choices.items():
          assert sub.prog == f"{command} {name}", sub.prog
          parsers.append(sub)
        action = action._choices_actions   # the subcommands' one-line helps
      for one in action if isinstance(action, list) else [action]:
        name = "/".join(one.option_strings) or one.dest
        text = one.help or ""
        assert text[:1].isupper() and text.endswith("."), f"{parser.prog} {name}: {text!r}"
    assert "__main__" not in parser.format_help()


def test_plan_prints_its_answer_first_and_the_table_on_request(capsys):
  assert plan.main(["--profile", "h100_node", "--pool", "2"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[1].startswith("best: ") and "strategies fit (the table of all: --all)" in lines[1]
  assert lines[2].startswith("pool: ") and len(lines[2].split(", ")) == 2
  assert [line.split(":")[0].strip() for line in lines[4:6]] == lines[2][6:].split(", ")
  command = lines[-2]
  assert command.startswith("train with: python train.py --gin_file=") and (
      "default.gin --gin_bindings=\"strategy.pool = [" in command), command
  assert lines[-1] == "launch: that command on one host with 8 GPUs", lines[-1]
  assert not any(line.startswith("strategy ") for line in lines)   # no table
  assert len(lines) == 8, lines
  assert plan.main(["--profile", "h100_node", "--pool", "2", "--all"]) == 0
  full = capsys.readouterr().out.splitlines()
  assert full[:8] == lines[:1] + [lines[1].replace(" (the table of all: --all)", "")] + lines[2:]
  assert full[8].startswith("strategy ") and len(full) > 100


def _printed_command(lines: list[str]) -> tuple[list[str], list[str]]:
  """(gin files, bindings) of plan's "train with:" line, as train.py's shell would split it."""
  import shlex

  words = shlex.split(next(line for line in lines if line.startswith("train with: "))[12:])
  assert words[:2] == ["python", "train.py"], words
  files = [w.split("=", 1)[1] for w in words[2:] if w.startswith("--gin_file=")]
  bindings = [w.split("=", 1)[1] for w in words[2:] if w.startswith("--gin_bindings=")]
  assert len(files) + len(bindings) == len(words) - 2, words
  return [os.path.join(REPO_ROOT, f) if not os.path.isabs(f) else f for f in files], bindings


def test_plan_prints_a_command_that_trains_the_pool_as_planned_and_how_to_launch_it(
    capsys, monkeypatch):
  """The printed command switches (strategy.every > 0) among the printed pool with the
  profile it was planned on, on as many devices as planned; the launch line starts it."""
  from moejax.strategy.spec import check_pool, parse

  monkeypatch.chdir(REPO_ROOT)   # the command names its gin file relative to here
  assert plan.main(["--profile", "cpu", "--pool", "2", "--devices", "16", "--every", "20"]) == 0
  lines = capsys.readouterr().out.splitlines()
  pool = lines[2].removeprefix("pool: ").split(", ")
  cfg = train.parse_config(*_printed_command(lines))
  assert list(cfg.strategy.pool) == pool and len(pool) == 2, (cfg.strategy, pool)
  assert (cfg.strategy.every, cfg.strategy.profile) == (20, "cpu"), cfg.strategy
  assert cfg.mesh.host_device_count == 16
  check_pool([parse(p) for p in pool], cfg, 16)   # what the trainer checks before compiling
  assert lines[-1].startswith("launch: that command on this host's CPU (16 fake devices"), lines
  assert "python -m moejax.launch -n 2 -d 8 -- followed by it" in lines[-1], lines[-1]
  assert plan.main(["--profile", "h100_node", "--pool", "2", "--devices", "64"]) == 0
  lines = capsys.readouterr().out.splitlines()
  cfg = train.parse_config(*_printed_command(lines))
  assert (cfg.strategy.every, cfg.strategy.profile) == (50, "h100_node"), cfg.strategy
  check_pool([parse(p) for p in cfg.strategy.pool], cfg, 64)
  assert "srun --nodes=8 --ntasks-per-node=1 --gpus-per-node=8 followed by that command" in (
      lines[-1]), lines[-1]
  assert "JAX_NUM_PROCESSES=8 JAX_PROCESS_ID=0..7" in lines[-1], lines[-1]


def test_launch_passes_output_on_without_gloos_all_connected_lines():
  import io

  from moejax.runtime.streams import pump

  gloo = b"[Gloo] Rank %d is connected to %d peer ranks. Expected number of connected peer " \
         b"ranks is : %d\n"
  lines = [b"XLA_FLAGS=...\n", gloo % (0, 7, 7), b"[Gloo] Rank " + gloo % (1, 7, 7),
           gloo % (2, 6, 7), b"steps 0..1: loss 6.4 -> 6.3\n"]
  out = io.BytesIO()
  pump(io.BytesIO(b"".join(lines)), b"[1] ", out)
  assert out.getvalue() == b"".join(b"[1] " + line for line in (lines[0], lines[3], lines[4]))
