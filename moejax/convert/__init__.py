"""Hugging Face checkpoints in and out: Mixtral, Qwen3-MoE, OLMoE (`moejax.convert.families`)
and the DeepSeek-V3 architecture (`moejax.convert.deepseek`).

`from_hf` (moejax.convert.hf_in) writes a weights-only step-0 checkpoint and the gin config of
the model; a run starts from it with `train.init_from`. `to_hf` (moejax.convert.hf_out) writes
a run's latest weights back as safetensors shards and a config.json. Both need the `hf` extra
(`safetensors`); `transformers` is needed only to run the result.
"""

from moejax.convert.hf_in import from_hf
from moejax.convert.hf_out import to_hf

__all__ = ["from_hf", "to_hf"]
