"""Strategies, the compiled program's choices (mesh factoring, expert mode, slots, capacity,
dispatch), priced before anything compiles: specs and their space, the whole-step cost model
over a hardware profile (with the GPUs' measured rates, `hardware.py`), the collective calls
and the memory of a step, the offline ranking and the online switch."""
