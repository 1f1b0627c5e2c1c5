"""moejax: a JAX trainer for mixture-of-experts transformers with layouts as data.

Shape letters. An array's name ends in its shape, one capital letter per axis joined by `x`:
`x_TxD` is [tokens, d_model], `w_ExDxF` is [experts, d_model, d_ff]. Each letter means one
thing everywhere in moejax (and in pallas_kernels, benchmarks and tests):

  A  (token, k) choices on one device, A = T*K
  B  batch: sequences
  C  slots per device (of the expert axis)
  D  d_model, the residual width
  E  experts
  F  FFN hidden width (d_ff of the dense MLP and of each expert)
  G  row groups of a grouped matmul (one per local slot)
  H  attention heads
  I  input features of a generic matmul (kernel contracts: x_MxI @ w_GxIxO)
  J  attention head dim
  K  top-k: choices per token
  L  MoE layers (the leading axis of every Layout table)
  M  rows of a grouped-matmul buffer (rows regrouped slot by slot)
  N  devices on the expert axis
  O  output features of a generic matmul
  P  positions within one (source, slot) capacity block: P = capacity
  Q  sequence positions (length)
  R  replica slots of one expert (Layout.expert_slots_LxExR; ep: R = 1)
  S  slots of one expert group, S = N*C
  T  tokens on one device
  U  rows of an exchange buffer (send or receive) or of one slot's part of it
  V  vocabulary
  W  token sources: the devices (or trace workers) whose choices are counted, e.g. counts_WxE
  Y  candidate layouts the fsep planner scores together (placement/fsep/)
  Z  finished steps of a count history or trace, e.g. counts_ZxLxWxE

A flattened axis has no letter of its own; say its shape in a comment. `Q1` is Q + 1 (a
training batch holds each sequence's inputs and its next-token targets). Scalars and host
integers use words (`num_slots`, `cap`), not letters.
"""
