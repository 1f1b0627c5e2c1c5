"""Shape suffixes use only the legend's letters (moejax.SHAPE_LETTERS), everywhere."""

from __future__ import annotations

import pathlib
import re

from moejax import SHAPE_LETTERS

ROOT = pathlib.Path(__file__).resolve().parent.parent
TREES = ("moejax", "pallas_kernels", "benchmarks", "tests")
# A name's shape suffix: axes joined by `x`, each a letter, letters run together (a flattened
# axis) or a lowercase word, with at least one capital letter.
SUFFIX = re.compile(r"\b_*[a-z][a-z0-9_]*?_((?:[A-Za-z]+x)*[A-Za-z]+)\b")
AXIS = re.compile(r"[A-Z]+|[a-z]+")


def _letters_outside_the_legend(text: str) -> dict[str, set[str]]:
  """{name: its capital letters the legend lacks} for every shape-suffixed name in `text`."""
  bad = {}
  for m in SUFFIX.finditer(text):
    axes = m.group(1).split("x")
    if not any(c.isupper() for c in m.group(1)):
      continue
    if not all(AXIS.fullmatch(a) for a in axes):       # CamelCase or other: not a shape
      continue
    outside = {c for a in axes if a.isupper() for c in a} - set(SHAPE_LETTERS)
    if outside:
      bad[m.group(0)] = outside
  return bad


def test_legend_has_at_most_twelve_letters_one_meaning_each():
  assert len(SHAPE_LETTERS) <= 12, sorted(SHAPE_LETTERS)
  assert all(len(k) == 1 and k.isupper() for k in SHAPE_LETTERS)
  meanings = list(SHAPE_LETTERS.values())
  assert len(set(meanings)) == len(meanings), "two letters share a meaning"


def test_every_shape_suffix_uses_legend_letters():
  bad = {}
  for tree in TREES:
    for path in sorted((ROOT / tree).rglob("*.py")):
      for name, letters in _letters_outside_the_legend(path.read_text()).items():
        bad[f"{path.relative_to(ROOT)}: {name}"] = "".join(sorted(letters))
  assert not bad, (f"shape letters outside moejax.SHAPE_LETTERS ({''.join(SHAPE_LETTERS)}): "
                   f"{dict(list(bad.items())[:20])} ({len(bad)} names); use a legend letter, "
                   "a flattened group (TK) or a lowercase word for the axis")


def test_the_check_sees_what_it_should():
  outside = "y_" + "MxI"            # built here so that the scan of this file stays clean
  assert _letters_outside_the_legend(f"x_BxQxD = {outside} + w_CxDxffn + s_WxTK") == {
      outside: {"M", "I"}}
  assert _letters_outside_the_legend("self.num_layers_Q1 EXCESS_SAMPLES MoEStats") == {}
