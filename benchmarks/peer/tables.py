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
        rows.append([r["path"], devices, f"{r['fwd_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}",
                     pct(r["dropped_fraction"]), agree, f"`{name}`"])
  head = []
  for name, d in files.items():
    device = d["metadata"]["machine"]["device"]
    if "GPU" not in device and "H100" not in device and "H200" not in device:
      continue
    for mesh in d["meshes"].values():
      pairs = mesh.get("summary", [])
      if pairs:
        head.append((f"Our MoE layer vs MaxText's fastest path at equal drops (dropless; "
                     f"capacity), forward+backward, on {device}",
                     "; ".join(f"{s['ours']} {s['ours_fwd_bwd_ms']:.2f} ms vs {s['maxtext']} "
                               f"{s['maxtext_fwd_bwd_ms']:.2f} ms, ours {s['fwd_bwd_ratio']:.2f}x "
                               f"as fast (forward {s['fwd_ratio']:.2f}x)"
                               + ("" if s.get("maxtext_agrees") is not False else
                                  ", MaxText's output or gradients off ours beyond the "
                                  "tolerance") for s in pairs), name))
  return Section(["Interleaved rounds, median ms; relative error of MaxText's output and "
                  "expert-weight gradients against ours on the same inputs. On CPU, XLA turns "
                  "ragged_dot into a dense matmul over every group, so these times say little "
                  "about a GPU.", "",
                  *table(["path", "devices", "fwd ms", "fwd+bwd ms", "dropped",
                          "y / grad rel. error vs ours", "file"], rows)], head)
