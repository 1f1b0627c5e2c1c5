"""moejax: a JAX trainer for mixture-of-experts transformers with layouts as data.

Shape names. An array's name ends in its shape, one letter of `SHAPE_LETTERS` per axis joined
by `x`: `x_TxD` is [tokens, d_model], `counts_LxWxE` [MoE layers, sources, experts]. Letters
run together name one flattened axis (`slot_TK` is [T*K], `slot_WxTK` [W, T*K]). An axis the
legend has no letter for is a lowercase word joined the same way (`w_CxDxffn`, `x_rowsxin`,
`counts_stepsxLxWxE`); `Q1` is Q + 1 (a batch holds each sequence's inputs and its next-token
targets). Scalars and host integers use words (`num_slots`, `cap`). tests/test_shape_legend.py
checks every module of moejax, pallas_kernels, benchmarks and tests against the legend.
"""

# The shape legend: each letter means one thing everywhere.
SHAPE_LETTERS = {
    "B": "batch: sequences",
    "C": "expert slots per device (the row groups of a grouped matmul)",
    "D": "d_model, the residual width",
    "E": "experts",
    "K": "top-k: choices per token",
    "L": "MoE layers (the leading axis of every Layout table)",
    "N": "devices on the expert axis",
    "Q": "positions in a sequence",
    "R": "replica slots of one expert (Layout.expert_slots_LxExR; ep: R = 1)",
    "S": "slots of one expert group, S = N*C",
    "T": "tokens on one device",
    "W": "token sources: the devices (or trace workers) whose choices are counted",
}
