"""Is our MoE layer ahead of a peer's at the same shapes, routing and drops? MaxText's
RoutedMoE beside ours, forward and backward, interleaved. README.md says how to rerun each
study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
