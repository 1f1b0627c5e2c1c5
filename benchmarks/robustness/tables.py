"""How the results of the kill soak read as tables: the families of results/, registered with
`benchmarks.families.family`; `python -m benchmarks.render` assembles them."""

from __future__ import annotations

from benchmarks.families import Section, family, num, table


@family("chaos", "Kill soak: killed and resumed, compared bit for bit")
def _chaos(files):
  rows, head = [], []
  for name, d in files.items():
    s = d["summary"]
    rows.append([s["kills_survived"], s["sigterm_stops"], s["kills_during_a_save"],
                 s["kills_inside_a_migration"], s["steps_recomputed"], num(s["seconds_lost"], 1),
                 "yes" if s["final_digest_identical"] else "no",
                 "yes" if s["metrics_identical"] else "no", f"`{name}`"])
    same = s["final_digest_identical"] and s["metrics_identical"]
    head.append((f"kill soak: {s['kills_survived']} SIGKILLs (in saves and migrations too), "
                 "each resumed: final state and metrics vs an uninterrupted run",
                 "bit for bit the same" if same else "different", name))
  return Section(table(["kills", "SIGTERM stops", "kills in a save", "kills in a migration",
                        "steps recomputed", "seconds lost", "same final state",
                        "same metrics", "file"], rows), head)
