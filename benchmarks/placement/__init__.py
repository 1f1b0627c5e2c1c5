"""The placement policies and their planners: how even each keeps the devices' load on routing
traces, how long a decision takes, what a migration sends, what re-planning costs a job, and
which router pairs with which placement. README.md
says how to rerun each study and which decisions its results feed."""

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
