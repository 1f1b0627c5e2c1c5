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


DECISIONS = ROOT / "docs" / "decisions"
INDEX = DECISIONS / "README.md"
# A pointer paragraph under a record's date, and the one the other record must carry.
INVERSE = {"Refines": "Refined by", "Refined by": "Refines",
           "Supersedes": "Superseded by", "Superseded by": "Supersedes"}
RECORD_LINK = re.compile(r"\[(\d{4})\]\((\d{4}-[^)]+\.md)\)")
# What a record's prose may say of another: a later one names what it refines or replaces,
# an earlier one what refined or superseded it.
SAYS_LATER = re.compile(r"\b(?:replaces|supersedes|refines)\s+(?:decisions?\s+)?\[?(\d{4})", re.I)
SAYS_EARLIER = re.compile(
    r"\b(?:refined\s+(?:in|by)|superseded\s+(?:on\s+[\d-]+\s+)?by)\s+(?:decisions?\s+)?\[?(\d{4})",
    re.I)


def _records() -> dict[str, pathlib.Path]:
  return {p.name[:4]: p for p in sorted(DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md"))}


def _pointers(path: pathlib.Path) -> tuple[dict[str, list[tuple[str, str]]], str]:
  """The record's pointer paragraphs under its date ({kind: [(number, file)]}) and the rest."""
  paragraphs = path.read_text().split("\n\n")
  pointers: dict[str, list[tuple[str, str]]] = {}
  rest = 2  # the title, then the date line
  while rest < len(paragraphs) and paragraphs[rest].split(":", 1)[0] in INVERSE:
    kind, links = paragraphs[rest].split(":", 1)
    assert kind not in pointers, f"{path.name}: two '{kind}:' lines; make them one"
    pointers[kind] = RECORD_LINK.findall(links)
    rest += 1
  return pointers, "\n\n".join(paragraphs[rest:])


def test_every_record_opens_with_its_number_and_date():
  bad = []
  for number, path in _records().items():
    lines = path.read_text().splitlines()
    if not lines[0].startswith(f"# {number}. "):
      bad.append(f"{path.name}: the first line is not '# {number}. TITLE'")
    if len(lines) < 3 or lines[1] or not re.match(r"Date: \d{4}-\d{2}-\d{2}", lines[2]):
      bad.append(f"{path.name}: the third line is not 'Date: YYYY-MM-DD ...' after a blank one")
  assert not bad, "\n".join(bad)


def test_the_decisions_index_lists_every_record_by_number():
  rows = re.findall(r"^\| \[(\d{4})\]\(([^)]+)\) \| ([\d-]+) \|", INDEX.read_text(), re.M)
  numbers = [number for number, _, _ in rows]
  assert numbers == sorted(set(numbers)), (
      f"docs/decisions/README.md's table is not in ascending order of number, once each: {numbers}")
  records = _records()
  unlisted = sorted(set(records) - set(numbers))
  assert not unlisted, f"docs/decisions/README.md's table has no row for {unlisted}; add one each"
  wrong = []
  for number, target, date in rows:
    path = records.get(number)
    if path is None or target != path.name:
      wrong.append(f"row {number} links {target}, not a record of that number")
    elif f"Date: {date}" not in path.read_text().splitlines()[2]:
      wrong.append(f"row {number} says {date}; the record's date line says otherwise")
  assert not wrong, "docs/decisions/README.md: " + "; ".join(wrong)


def test_refinements_point_both_ways():
  """`Refines:` in a later record and `Refined by:` in the earlier one (likewise `Supersedes:` /
  `Superseded by:`), right under the date; what a record's prose says of another is among
  them; a superseded record's index row says so."""
  records = _records()
  pointers = {n: _pointers(p) for n, p in records.items()}
  index_rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| \[(\d{4})\].*$",
                                                             INDEX.read_text(), re.M)}
  bad = []
  for number, (kinds, body) in pointers.items():
    name = records[number].name
    for kind, links in kinds.items():
      for other, target in links:
        if other not in records or target != records[other].name:
          bad.append(f"{name}: '{kind}:' links {target}, not the record {other}")
          continue
        later = kind in ("Refines", "Supersedes")
        if (other < number) != later:
          bad.append(f"{name}: '{kind}: {other}' points the wrong way in time")
        if number not in {n for n, _ in pointers[other][0].get(INVERSE[kind], [])}:
          bad.append(f"{name} says '{kind}: {other}', but {records[other].name} has no "
                     f"'{INVERSE[kind]}: [{number}]({name})' under its date: add it there")
    for line in body.splitlines():
      if line.split(":", 1)[0] in INVERSE:
        bad.append(f"{name}: '{line[:40]}' is below the body's start; pointers go right "
                   "under the date")
    named_later = {n for k in ("Refines", "Supersedes") for n, _ in kinds.get(k, [])}
    named_earlier = {n for k in ("Refined by", "Superseded by") for n, _ in kinds.get(k, [])}
    for other in set(SAYS_LATER.findall(body)) - named_later:
      bad.append(f"{name}'s text says it replaces or refines {other}: add 'Refines: [{other}]"
                 f"(...)' (or 'Supersedes:') under its date, and the way back in {other}")
    for other in set(SAYS_EARLIER.findall(body)) - named_earlier:
      bad.append(f"{name}'s text says {other} refined or superseded it: add 'Refined by: "
                 f"[{other}](...)' (or 'Superseded by:') under its date")
    superseded = {n for n, _ in kinds.get("Superseded by", [])}
    said = set(re.findall(r"\(superseded by (\d{4})\)", index_rows.get(number, "")))
    if superseded != said:
      bad.append(f"docs/decisions/README.md's row {number} says superseded by {sorted(said)}, "
                 f"the record {sorted(superseded)}: write '(superseded by NNNN)' for each")
  assert not bad, "decision records' pointers:\n  " + "\n  ".join(bad)
