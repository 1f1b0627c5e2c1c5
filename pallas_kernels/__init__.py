"""Pallas kernels for MoE dispatch: permute, unpermute-combine, grouped matmul.

Public entry points (each with a frozen tuning dataclass, a plain-jnp reference and a
custom_vjp): `permute.permute`, `unpermute.unpermute_combine`, `grouped_matmul.gmm` / `tgmm`.
Where they are lowered (interpret / Triton / Mosaic GPU) is decided in `backend`. Their tile
sweeps live in `python -m benchmarks.kernels.kernels`.
"""
