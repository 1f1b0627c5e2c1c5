"""The training loop and what it drives: the AOT-compiled programs of a strategy pool, the
pure train step and its loss, state, optimizer, data, checkpoints, metrics, the hooks that
re-plan the layout or switch strategies, and the run directory's files."""
