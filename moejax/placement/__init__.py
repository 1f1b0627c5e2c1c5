"""Host-side expert placement, numpy only: the planners that choose a layout from routing
counts (SmartMoE, shadow experts, fsep's replica planner), the per-layer cost they decide by,
re-planning during a run, and routing traces recorded, replayed and synthesised."""
