"""`python -m moejax.convert from_hf HF_DIR RUN_DIR [--mesh 1,8,1] [--expert_mode ep|fsep]` and
`python -m moejax.convert to_hf RUN_DIR OUT_DIR [--family NAME] [--dtype bfloat16]`.

The shell around `moejax.convert.hf_in` / `hf_out`: a missing input is one `error:` line that
says what to give, and a conversion that fails leaves nothing of its output behind."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import shutil
import sys
import time

from moejax.config import ConfigError
from moejax.convert import families
from moejax.runtime.cli import ArgumentParser, fail

DEFAULT_MESH = (1, 8, 1)
# owner/name as the Hugging Face hub spells a model id
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _mesh(text: str) -> tuple[int, int, int]:
  try:
    parts = tuple(int(p) for p in text.split(","))
  except ValueError:
    parts = ()
  if len(parts) != 3:
    raise argparse.ArgumentTypeError(f"--mesh {text!r}: give data,expert,model, e.g. 1,8,1")
  return parts


def peak_rss_mib() -> float:
  """This process's peak resident memory: VmHWM, which starts afresh at exec (ru_maxrss keeps
  the peak of the process that started this one)."""
  try:
    with open("/proc/self/status") as f:
      return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
  except (OSError, StopIteration):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def parser() -> ArgumentParser:
  p = ArgumentParser(
      prog="python -m moejax.convert",
      description="Converts a Hugging Face checkpoint (Mixtral, Qwen3-MoE, OLMoE) into a moejax "
                  "run dir to train from (from_hf), and a run's latest weights back into "
                  "safetensors that transformers loads (to_hf).")
  sub = p.add_subparsers(dest="command", required=True, metavar="{from_hf,to_hf}")
  mesh = ",".join(map(str, DEFAULT_MESH))
  into = sub.add_parser(
      "from_hf", help="A Hugging Face checkpoint directory -> a step-0 moejax run dir.",
      description="Writes RUN_DIR/checkpoints/0 (the weights), RUN_DIR/model.gin (the model, "
                  "the mesh and the expert mode to train with) and RUN_DIR/hf (the model's "
                  "config and tokenizer files).")
  into.add_argument("hf_dir", help="The local directory save_pretrained or `hf download` wrote "
                                   "(config.json and model*.safetensors), not a hub id.")
  into.add_argument("run_dir", help="The new run dir to write.")
  into.add_argument("--mesh", type=_mesh, default=DEFAULT_MESH,
                    help=f"The data,expert,model sizes of the training mesh, -1 for the rest "
                         f"(default {mesh}).")
  into.add_argument("--expert_mode", choices=("ep", "fsep"), default="ep",
                    help="The expert mode to train in (default ep).")
  into.add_argument("--slots", type=int, default=0,
                    help="The fsep slots per device (default 0: the trainer's default).")
  into.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                    help="The compute dtype of the run; params stay float32 (default bfloat16).")
  out = sub.add_parser(
      "to_hf", help="A moejax run dir's latest weights -> safetensors and a config.json.",
      description="Writes OUT_DIR/model.safetensors (or model-0000i-of-0000n.safetensors shards "
                  "and their index when the weights exceed one shard) and a config.json that "
                  "transformers loads.")
  out.add_argument("run_dir", help="A run dir that trained, or one that from_hf wrote.")
  out.add_argument("out_dir", help="The directory to write the safetensors into.")
  out.add_argument("--family", help=f"The family to write, {_family_names()} (default: the "
                                    "converted model's own).")
  out.add_argument("--dtype", help="The tensors' dtype (default: the converted config's, else "
                                   "float32).")
  out.add_argument("--max_shard_gib", type=float, default=5.0,
                   help="The largest shard in GiB; past it the weights go into several shards "
                        "(default 5).")
  return p


def _family_names() -> str:
  *rest, last = sorted(families.FAMILIES)
  return f"{', '.join(rest)} or {last}"


def _check_hf_dir(hf_dir: str) -> None:
  """A hub id or a directory that is not there: one line saying what from_hf reads."""
  if os.path.isdir(hf_dir):
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
      raise ConfigError(f"HF_DIR {hf_dir!r} has no config.json; give the directory that "
                        "save_pretrained or `hf download` wrote (config.json beside "
                        "model*.safetensors).")
    return
  if not os.path.exists(hf_dir) and _HUB_ID.fullmatch(hf_dir):
    local = hf_dir.rsplit("/", 1)[1]
    raise ConfigError(f"HF_DIR {hf_dir!r} is not a directory here; from_hf reads a checkpoint "
                      f"on disk, not from the hub: download it first (hf download {hf_dir} "
                      f"--local-dir {local}) and give {local!r}.")
  raise ConfigError(f"HF_DIR {hf_dir!r} is not a directory; give the directory that "
                    "save_pretrained or `hf download` wrote (config.json and "
                    "model*.safetensors).")


@contextlib.contextmanager
def _removed_on_error(path: str):
  """Whatever of `path` a failed conversion created is removed again: the directories it made
  (the outermost new one), or inside an existing `path` the entries that were not there."""
  path = os.path.abspath(path)
  top = path
  while not os.path.exists(os.path.dirname(top)):
    top = os.path.dirname(top)
  before = set(os.listdir(path)) if os.path.isdir(path) else None
  try:
    yield
  except BaseException:
    if before is None:   # (a file of the user's at `path` is no directory: left alone)
      shutil.rmtree(top, ignore_errors=True)
    else:
      for name in set(os.listdir(path)) - before:
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
          shutil.rmtree(target, ignore_errors=True)
        else:
          with contextlib.suppress(OSError):
            os.unlink(target)
    raise


def _missing_extra(e: ImportError) -> ConfigError | None:
  if (e.name or "").split(".")[0] == "safetensors":
    return ConfigError("python -m moejax.convert needs safetensors: pip install -e '.[hf]' "
                       "(install torch==2.13.0 first, see the guide).")
  return None


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  start = time.perf_counter()
  try:
    if args.command == "from_hf":
      _check_hf_dir(args.hf_dir)
      with _removed_on_error(args.run_dir):
        from moejax.convert.hf_in import GIN_FILE, from_hf

        from_hf(args.hf_dir, args.run_dir, args.mesh, args.expert_mode, args.dtype, args.slots)
      done = f"wrote {args.run_dir}/checkpoints/0 and {args.run_dir}/{GIN_FILE}"
    else:
      if args.max_shard_gib <= 0:
        raise ConfigError(f"--max_shard_gib={args.max_shard_gib} must be > 0; e.g. 5.")
      with _removed_on_error(args.out_dir):
        from moejax.convert.hf_out import to_hf

        to_hf(args.run_dir, args.out_dir, args.family, args.dtype,
              int(args.max_shard_gib * 2**30))
      done = f"wrote {args.out_dir}"
  except ConfigError as e:
    return fail(str(e))
  except ImportError as e:
    if (error := _missing_extra(e)) is None:
      raise
    return fail(str(error))
  print(f"{done}; {time.perf_counter() - start:.1f} s, peak RSS {peak_rss_mib():.0f} MiB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
