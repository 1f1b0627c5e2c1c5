"""`python -m moejax.convert from_hf HF_DIR RUN_DIR [--mesh 1,8,1] [--expert_mode ep|fsep]` and
`python -m moejax.convert to_hf RUN_DIR OUT_DIR [--family NAME] [--dtype bfloat16]`."""

from __future__ import annotations

import argparse
import resource
import sys
import time

from moejax.config import ConfigError


def _mesh(text: str) -> tuple[int, int, int]:
  parts = tuple(int(p) for p in text.split(","))
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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  into = sub.add_parser("from_hf", help="a Hugging Face checkpoint -> a step-0 moejax run dir")
  into.add_argument("hf_dir")
  into.add_argument("run_dir")
  into.add_argument("--mesh", type=_mesh, default=(1, 8, 1),
                    help="data,expert,model sizes of the training mesh (-1: the rest)")
  into.add_argument("--expert_mode", choices=("ep", "fsep"), default="ep")
  into.add_argument("--slots", type=int, default=0, help="fsep slots per device (0: default)")
  into.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                    help="compute dtype of the run (params stay float32)")
  out = sub.add_parser("to_hf", help="a moejax run dir's latest weights -> safetensors")
  out.add_argument("run_dir")
  out.add_argument("out_dir")
  out.add_argument("--family", help="mixtral, qwen3_moe or olmoe (default: the converted one's)")
  out.add_argument("--dtype", help="tensor dtype (default: the converted config's, else float32)")
  out.add_argument("--max_shard_gib", type=float, default=5.0)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  try:
    if args.command == "from_hf":
      from moejax.convert.hf_in import GIN_FILE, from_hf

      from_hf(args.hf_dir, args.run_dir, args.mesh, args.expert_mode, args.dtype, args.slots)
      done = f"wrote {args.run_dir}/checkpoints/0 and {args.run_dir}/{GIN_FILE}"
    else:
      from moejax.convert.hf_out import to_hf

      to_hf(args.run_dir, args.out_dir, args.family, args.dtype,
            int(args.max_shard_gib * 2**30))
      done = f"wrote {args.out_dir}"
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{done}; {time.perf_counter() - start:.1f} s, peak RSS {peak_rss_mib():.0f} MiB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
