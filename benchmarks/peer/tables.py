"""How the peer comparison reads as a table: MaxText's MoE layer beside ours on the same weights,
tokens and drops; the family of results/, registered with `benchmarks.families.family`."""

from __future__ import annotations

from benchmarks.families import Section, family, pct, table


@family("peer_maxtext", "MaxText's MoE layer beside ours: same weights, tokens and drops")
def _peer_maxtext(files):
  rows = []
  for name, d in files.items():
    for devices, mesh in d["meshes"].items():
      for r in mesh["rows"]:
        if "error" in r:
          rows.append([r["path"], devices, "", "", "", r["error"].split(":")[0], f"`{name}`"])
          continue
        a = r.get("agreement", {})
        agree = (f"{a['y_rel']:.1e} / {max(a['grad_rel'].values()):.1e}" if "y_rel" in a
                 else "")
        rows.append([r["path"], devices, f"{r['fwd_ms']:.1f}", f"{r['fwd_bwd_ms']:.1f}",
                     pct(r["dropped_fraction"]), agree, f"`{name}`"])
  return Section(["Interleaved rounds, median ms; relative error of MaxText's output and "
                  "expert-weight gradients against ours on the same inputs. On CPU, XLA turns "
                  "ragged_dot into a dense matmul over every group, so these times say little "
                  "about a GPU.", "",
                  *table(["path", "devices", "fwd ms", "fwd+bwd ms", "dropped",
                          "y / grad rel. error vs ours", "file"], rows)])
