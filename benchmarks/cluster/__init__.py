"""The cluster study: what balancing the experts would buy a GPU cluster, per model, GPU count,
routing and placement policy, from XLA:GPU's compiled programs for compile-only H100s and the
trainer's own planners replayed on routing traces (`python -m benchmarks.cluster.study --help`).

Its modules, one concern each: `routing` (traces scaled to a model's experts and a mesh's
sources, and the force-balanced routing), `replays` (each policy's capacity factor for <= 1%
drops, busiest device, migrations and planner time, by the trainer's own re-planner),
`programs` (the programs compiled once per distinct buffer, their schedule estimates and how
a routing's rows scale them), `study` (the rows and the command line), `cpu` (the same
fraction measured on the 8 fake CPU devices, through `benchmarks.layer.balance_pays`),
`layers` (the programs' per-layer scaling), `tables` (how the results render).
"""
