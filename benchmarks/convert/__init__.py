"""Does the Hugging Face conversion (`moejax.convert`) fit the host memory its arithmetic says it
needs? README.md
says how to rerun each study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
