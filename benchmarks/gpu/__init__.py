"""The program on GPUs: compiled for compile-only H100s on this host (memory, collectives, the
schedule estimate), measured on a lent GPU (train steps, MFU, the rates an estimate needs),
and predicted against Megatron-Core's published Mixtral-8x7B step. README.md
says how to rerun each study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
