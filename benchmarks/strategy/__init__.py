"""The strategy cost model and the online switch: does the model predict measured step times,
and does switching strategy under a drifting load beat every strategy held fixed? README.md
says how to rerun each study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
