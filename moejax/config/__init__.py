"""Frozen configuration dataclasses, one per concern, and their one-line checks.

Nothing here imports JAX, so that `train.py` can parse gin files and decide how many host
devices to fake *before* JAX is imported. Every default of the project lives here; `train.py`
only binds values to these classes. `program`: what the compiled program is (mesh, model,
MoE); `run`: what a run does with it (data, optimizer, checkpoints, loop, planner, pool);
`checks`: the error type and the rules several sections share.
"""

from moejax.config.checks import (  # noqa: F401
    ConfigError,
    batch_split_error,
    check_field_types,
    check_ranges,
    microbatch_split_error,
)
from moejax.config.program import (  # noqa: F401
    MOE_CHOICES,
    PALLAS_BACKENDS,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    default_fsep_slots,
    num_moe_layers,
)
from moejax.config.run import (  # noqa: F401
    CheckpointConfig,
    Config,
    DataConfig,
    OptimConfig,
    PlannerConfig,
    StrategyConfig,
    TraceConfig,
    TrainConfig,
)
