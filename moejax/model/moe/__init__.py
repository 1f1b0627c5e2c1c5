"""The MoE layer inside one `shard_map`, one module per stage of a token's trip: route,
choose a slot (fsep's replicas), dispatch (dense, pooled or ragged), the experts (ep or fsep,
whose weights are restored each step), combine; beside them the single-device reference every
path must equal (`reference.py`)."""
