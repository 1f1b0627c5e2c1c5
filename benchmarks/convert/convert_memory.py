"""Host memory of `python -m moejax.convert` against its arithmetic, at a size this machine holds.

`python -m benchmarks.convert.convert_memory [--layers 8 --d_model 512 --d_ff 1792 --vocab 32000]
[--json OUT]` builds a random Mixtral-shaped model with transformers (bfloat16, 50 MB shards),
runs `from_hf` and `to_hf` as the user does (separate processes) and records each one's peak
resident memory beside the arithmetic of docs/guide/start-from-a-published-model.md: the
float32 parameters P, the largest parameter W (the w_gate of all layers), the imports B;
reading needs B + P + W, the digest (array by array, temporaries 2W) B + P + 2W.
Needs the `hf` extra.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from benchmarks.common import command, start, write_result
from benchmarks.convert import RESULTS

MIB = 2**20


def _peak_mib(args: list[str]) -> float:
  """Peak RSS (MiB) that `python -m moejax.convert ARGS` reports."""
  out = subprocess.run([sys.executable, "-m", "moejax.convert", *args], capture_output=True,
                       text=True, check=True).stdout
  return float(re.search(r"peak RSS (\d+) MiB", out).group(1))


def _baseline_mib() -> float:
  """Peak RSS (MiB) of a process that imports what the converter imports, and computes nothing
  (XLA's compilers and arenas come later, and their memory is reused by the arrays)."""
  code = "import moejax.convert.__main__ as m; print(m.peak_rss_mib())"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.convert.convert_memory",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d_model", type=int, default=512)
  parser.add_argument("--d_ff", type=int, default=1792)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--json", default=os.path.join(RESULTS, "convert_memory.json"))
  args = parser.parse_args(argv)
  import torch
  from transformers import AutoModelForCausalLM, MixtralConfig

  load_before = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as tmp:
    cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.d_model,
                        intermediate_size=args.d_ff, num_hidden_layers=args.layers,
                        num_attention_heads=8, num_key_value_heads=2,
                        num_local_experts=args.experts, num_experts_per_tok=2,
                        max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(os.path.join(tmp, "hf"), max_shard_size="50MB")
    del model
    run, out = os.path.join(tmp, "run"), os.path.join(tmp, "out")
    from_hf = _peak_mib(["from_hf", os.path.join(tmp, "hf"), run, "--mesh", "1,8,1"])
    to_hf = _peak_mib(["to_hf", run, out])
  base = _baseline_mib()
  p_mib = params * 4 / MIB
  w_mib = args.layers * args.experts * args.d_model * args.d_ff * 4 / MIB
  result = {
      "command": command("convert.convert_memory", argv), "load_before": load_before,
      "params": params, "float32_params_mib": round(p_mib, 1),
      "largest_param_mib": round(w_mib, 1), "jax_process_mib": round(base, 1),
      "from_hf_peak_mib": from_hf, "to_hf_peak_mib": to_hf,
      "arithmetic_read_peak_mib": round(base + p_mib + w_mib, 1),
      "arithmetic_digest_peak_mib": round(base + p_mib + 2 * w_mib, 1),
  }
  print({k: v for k, v in result.items() if k.endswith("mib")})
  write_result(result, args.json)


if __name__ == "__main__":
  start()
  main()
