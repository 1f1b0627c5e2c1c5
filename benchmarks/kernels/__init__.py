"""The Pallas dispatch kernels: which tiling and which `moe.dispatch` / `moe.kernels` option is
fastest (on CPU in interpret mode, on a GPU for real), where a GPU spends the layer's time,
and whether every kernel compiles for sm_90a without spilling. README.md
says how to rerun each study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
