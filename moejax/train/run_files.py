"""What a run dir records of each start besides metrics and checkpoints: the config it ran
with, the files the front end hands over (the operative gin config), and memory.txt: XLA's
memory analysis of every pool member's compiled train step (what runs), then the arithmetic
model of the expert bytes (what to expect at other sizes)."""

from __future__ import annotations

import json
import os

from moejax.config import Config, num_moe_layers
from moejax.strategy import memory
from moejax.train.programs import Program, xla_memory


def memory_text(cfg: Config, programs: list[Program], active: Program) -> str:
  prog = active
  lines = [f"XLA compiled train step {member.strategy.spec}, bytes per device: " +
           ", ".join(f"{k} {v}" for k, v in xla_memory(member.train_step).items())
           for member in programs]
  lines.append("arithmetic model, " + memory.report(
      num_moe_layers(cfg.model, cfg.moe), cfg.moe.num_experts, cfg.model.d_model,
      cfg.moe.d_ff, prog.mesh.shape["expert"], prog.mesh.shape["model"],
      prog.cfg.moe.slots_per_device or None))
  return "\n".join(lines) + "\n"


def texts(cfg: Config, programs: list[Program], active: Program, run_files: dict[str, str],
          start: int) -> dict[str, str]:
  """{file name: text}: `run_files` and config.json, each also as NAME.<start>.EXT (config.0.json,
  config.30.json, ...), and memory.txt."""
  files = {**run_files, "config.json": json.dumps(cfg.to_dict(), indent=2)}
  files.update({f"{stem}.{start}{ext}": text for stem, ext, text in
                ((*os.path.splitext(name), text) for name, text in files.items())})
  files["memory.txt"] = memory_text(cfg, programs, active)
  return files
