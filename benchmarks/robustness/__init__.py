"""Does a job killed again and again (SIGKILL, SIGTERM, inside a checkpoint write or a
migration) and resumed each time end bit for bit where an uninterrupted run ends? README.md
says how to rerun each study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
