"""`python -m benchmarks.cluster`: the cluster study (benchmarks.cluster.study)."""

import sys

from benchmarks.cluster.study import main

sys.exit(main())
