"""What the A/B studies share: an earlier commit's `moejax.placement` loaded beside this tree's,
and whether two fsep plans are the same bit for bit."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tarfile

import numpy as np


def load_base(rev: str, into: str):
  """moejax.placement's fsep module as it was at git revision `rev`, as package `base_placement`
  under folder `into` (its own imports rewritten to point at that copy)."""
  archive = os.path.join(into, "base.tar")
  subprocess.run(["git", "archive", "-o", archive, rev, "moejax/placement"], check=True)
  with tarfile.open(archive) as tar:
    tar.extractall(into, filter="data")
  pkg = os.path.join(into, "base_placement")
  os.rename(os.path.join(into, "moejax", "placement"), pkg)
  for folder, _, names in os.walk(pkg):
    for name in names:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        with open(path) as f:
          text = f.read()
        text = re.sub(r"\bmoejax\.placement\b", "base_placement", text)
        with open(path, "w") as f:
          f.write(text)
  sys.path.insert(0, into)
  return importlib.import_module("base_placement.fsep")


def same_plan(a, b) -> bool:
  """Every array of two fsep plans equal, dtypes too."""
  arrays = [(a.slot_expert, b.slot_expert), (a.share, b.share)]
  if a.local is not None and b.local is not None:
    arrays.append((a.local, b.local))
  return ((a.local is None) == (b.local is None)
          and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in arrays))
