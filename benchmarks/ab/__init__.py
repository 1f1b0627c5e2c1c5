"""A planner of this tree against the same planner at an earlier commit, in one process: the
same plans bit for bit, and the time per decision interleaved call by call. README.md
says how to rerun each study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
