"""What runs on the devices: the one mesh and its logical -> physical rules, the GPT-MoE
Transformer (layers scanned in groups), the pipeline over `stage`, and the MoE layer (`moe/`).
Device code only: nothing here imports a host policy (moejax.placement, moejax.strategy)."""
