"""The data step: text files -> a prepared token directory (`python -m moejax.prepare_data`).

`train.bin` and `val.bin` hold one token stream each (uint16 or uint32, as the vocabulary
needs) and `meta.json` says how they were made; `data.path` = that directory trains on them
(moejax.train.data reads the format). Input is streamed in chunks, so memory stays bounded
whatever the input's size. A package rather than one module: the shell, the input stream and
the tokenizers are three concerns (docs/decisions/0031).
"""

from moejax.prepare_data.encoders import ByteEncoder, HFEncoder, load_encoder, train_bpe
from moejax.prepare_data.prepare import prepare
from moejax.prepare_data.sources import Chunk, input_files, stream_chunks

__all__ = ["ByteEncoder", "Chunk", "HFEncoder", "input_files", "load_encoder", "prepare",
           "stream_chunks", "train_bpe"]
