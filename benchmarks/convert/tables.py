"""How the results of the Hugging Face conversion's memory read as tables: the families of
results/, registered with `benchmarks.families.family`; `python -m benchmarks.render` assembles
them."""

from __future__ import annotations

from benchmarks.families import Section, family, num, table


@family("convert_memory", "Hugging Face conversion: peak host memory against the arithmetic")
def _convert_memory(files):
  rows = [[num(d["params"]), num(d["float32_params_mib"], 1), num(d["largest_param_mib"], 1),
           num(d["from_hf_peak_mib"], 0), num(d["to_hf_peak_mib"], 0),
           num(d["arithmetic_digest_peak_mib"], 0), f"`{name}`"] for name, d in files.items()]
  return Section(table(["parameters", "fp32 params MiB", "largest param MiB",
                        "from_hf peak MiB", "to_hf peak MiB", "arithmetic peak MiB", "file"],
                       rows))
