"""`python -m moejax.generate RUN_DIR --prompt TEXT` (or `--prompt_file FILE`, one prompt a
line): text sampled from a run's latest intact checkpoint with the run's tokenizer, greedy or
with temperature / top-k / top-p and a seed, over a KV cache; each prompt and its continuation
on stdout (library: `moejax.train.generation`)."""

from __future__ import annotations

import os
import sys
import time

from moejax import config as config_lib
from moejax.config import ConfigError
from moejax.evaluate import mesh_devices, run_config, set_xla_flags, with_mesh
from moejax.runtime.cli import ArgumentParser, fail


def parser() -> ArgumentParser:
  p = ArgumentParser(
      prog="python -m moejax.generate",
      description="Samples text from a run dir's latest intact checkpoint: each prompt, "
                  "tokenised with the run's tokenizer, continued over a KV cache with every "
                  "MoE choice computed (no capacity drops); prints each prompt with its "
                  "continuation.")
  p.add_argument("run_dir", help="A run dir that trained, or one that `python -m moejax.convert "
                                 "from_hf` wrote.")
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", help="The text to continue.")
  source.add_argument("--prompt_file", help="A text file of prompts, one a line (blank lines "
                                            "skipped), sampled together as one batch.")
  p.add_argument("--max_new_tokens", type=int, default=64,
                 help="Tokens to sample after each prompt (default 64; fewer where an "
                      "end-of-sequence token comes first).")
  p.add_argument("--temperature", type=float, default=0.8,
                 help="Softmax temperature (default 0.8; 0: greedy, always the likeliest).")
  p.add_argument("--top_k", type=int, default=0,
                 help="Sample among the k likeliest tokens only (default 0: all).")
  p.add_argument("--top_p", type=float, default=1.0,
                 help="Sample among the likeliest tokens whose probability reaches p, in (0, 1] "
                      "(default 1: all).")
  p.add_argument("--seed", type=int, default=0,
                 help="The sampling seed (default 0): a seed gives the same text every time.")
  p.add_argument("--tokenizer", default=None,
                 help="A tokenizer.json to use (default: the run's own: RUN_DIR/hf of a "
                      "converted model, its prepared data's, or bytes).")
  p.add_argument("--mesh", default=None,
                 help="The data,expert,model sizes to read the checkpoint on, e.g. 1,1,1 "
                      "(default: the run's strategy).")
  return p


def prompts_of(args) -> list[str]:
  if args.prompt is not None:
    if not args.prompt:
      raise ConfigError("--prompt '' is empty; give at least one character of text to continue.")
    return [args.prompt]
  if not os.path.isfile(args.prompt_file):
    raise ConfigError(f"--prompt_file {args.prompt_file!r} does not exist; give a text file with "
                      "one prompt a line.")
  with open(args.prompt_file, encoding="utf-8") as f:
    prompts = [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise ConfigError(f"--prompt_file {args.prompt_file!r} holds no prompt; give a text file "
                      "with one prompt a line.")
  return prompts


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  try:
    if not os.path.isdir(args.run_dir):
      raise ConfigError(f"RUN_DIR {args.run_dir!r} does not exist; give a run dir that trained "
                        "or that `python -m moejax.convert from_hf` wrote.")
    prompts = prompts_of(args)
    cfg = run_config(args.run_dir)
    if args.mesh is not None:
      cfg = with_mesh(cfg, args.mesh)
    cfg = cfg.validate()
    set_xla_flags(cfg, "generate")
    from moejax.train import generation  # imports jax: after XLA_FLAGS is settled
    from moejax.train.lock import RunDirLock

    sampling = generation.Sampling(args.temperature, args.top_k, args.top_p,
                                   args.max_new_tokens, args.seed).check(cfg.model.vocab_size)
    tokenizer = generation.run_tokenizer(cfg, args.run_dir, args.tokenizer)

    lock = RunDirLock(args.run_dir)
    for warning in lock.acquire():
      print(f"warning: {warning}", file=sys.stderr)
    try:
      gen = generation.Generator(cfg, args.run_dir,
                                 devices=mesh_devices(cfg) if args.mesh else None)
    finally:
      lock.release()
    for warning in gen.warnings:
      print(f"warning: {warning}", file=sys.stderr)
    trained = cfg.model.max_seq_len
    if max(len(tokenizer.encode(p)) for p in prompts) + sampling.max_new_tokens > trained:
      print(f"warning: prompt + --max_new_tokens runs past model.max_seq_len={trained}, the "
            "longest sequence the model trained on; text past it may degrade.", file=sys.stderr)
    start = time.perf_counter()
    done = gen.complete(prompts, tokenizer, sampling)
    seconds = time.perf_counter() - start
  except config_lib.ConfigError as e:
    return fail(str(e))
  tokens = sum(len(c.ids) for c in done)
  print(f"step {gen.step} of {args.run_dir} on {gen.where} ({tokenizer.name} tokenizer): "
        f"{len(done)} prompt(s), {tokens} tokens in {seconds:.1f} s, compile included",
        file=sys.stderr)
  for i, c in enumerate(done):
    print(("\n" if i else "") + c.prompt + c.text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
