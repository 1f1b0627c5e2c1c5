"""One MoE layer on a mesh: does it equal the single-device reference, what does it cost
forward and backward per expert mode and mesh, how large is its receive buffer, and does
balance pay in tokens/s at the capacity that keeps drops low? README.md
says how to rerun each study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
