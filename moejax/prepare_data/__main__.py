"""`python -m moejax.prepare_data --input 'DIR/**/*.txt' --out OUT [--tokenizer tokenizer.json |
--train_bpe VOCAB | --bytes]`: text files -> OUT/{train.bin, val.bin, meta.json}; then train on
them with `python train.py --gin_bindings="data.path = 'OUT'"`."""

from __future__ import annotations

import resource
import sys
import time

from moejax.config import ConfigError
from moejax.prepare_data.prepare import prepare
from moejax.runtime.cli import ArgumentParser


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="python -m moejax.prepare_data",
                     description="Tokenizes text files into a directory the trainer reads "
                                 "(train.bin, val.bin, meta.json); train on it with "
                                 "data.path = 'OUT'.")
  p.add_argument("--input", required=True,
                 help="A glob of the text files, quoted; '**' recurses ('DIR/**/*.txt'); one "
                      "big file works too.")
  p.add_argument("--out", required=True,
                 help="The directory to write (it must not hold a dataset already).")
  kind = p.add_mutually_exclusive_group(required=True)
  kind.add_argument("--tokenizer", help="A Hugging Face tokenizer.json to encode with.")
  kind.add_argument("--train_bpe", type=int, metavar="VOCAB",
                    help="Train a byte-level BPE of VOCAB ids (at least 257) on the input's "
                         "train split.")
  kind.add_argument("--bytes", action="store_true", help="Raw bytes, vocab 256.")
  p.add_argument("--exclude", action="append", default=[],
                 help="A glob of files to leave out (repeatable), e.g. '**/site-packages/**'.")
  p.add_argument("--val_fraction", type=float, default=0.05,
                 help="The share of the input's chunks (by a hash of file and chunk) that go to "
                      "val.bin (default 0.05).")
  p.add_argument("--no_progress", action="store_true", help="Show no progress bars.")
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  start = time.perf_counter()
  try:
    meta = prepare(args.input, args.out, tokenizer=args.tokenizer, bpe_vocab=args.train_bpe,
                   byte_level=args.bytes, val_fraction=args.val_fraction,
                   exclude=tuple(args.exclude), progress=not args.no_progress)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
  print(f"{meta['files']} files, {meta['bytes']:,} bytes -> {meta['train_tokens']:,} train + "
        f"{meta['val_tokens']:,} val tokens ({meta['dtype']}, vocab {meta['vocab_size']}) in "
        f"{args.out}; {time.perf_counter() - start:.1f} s, peak RSS {peak_mib:.0f} MiB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
