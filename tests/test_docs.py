"""The README stays a README (short, no measurement history) and every relative link in it,
in docs/ and in the lab's READMEs points at a file that exists."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_short_and_keeps_its_markers():
  text = README.read_text()
  lines = text.splitlines()
  assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/guide/"
  assert "load average" not in text.lower(), "measurements and their load go to docs/decisions/"
  for marker in ("<!-- run-command -->", "<!-- test-command -->", "<!-- results:begin -->",
                 "<!-- results:end -->"):
    assert marker in text, f"README.md lost {marker}"


def test_relative_links_resolve():
  docs = [README, *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").rglob("*.md")]
  broken = [f"{d.relative_to(ROOT)} -> {target}" for d in docs
            for target in LINK.findall(d.read_text())
            if "://" not in target and not (d.parent / target).exists()]
  assert not broken, f"links to missing files: {broken}"


def test_the_guide_index_lists_every_page():
  guide = ROOT / "docs" / "guide"
  index = (guide / "README.md").read_text()
  unlisted = [p.name for p in guide.glob("*.md") if p.name != "README.md" and
              f"]({p.name})" not in index]
  assert not unlisted, f"docs/guide/README.md does not list {unlisted}"
