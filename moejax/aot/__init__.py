"""The GPU program, compiled without a GPU: XLA:GPU's compile of the real train step for a
compile-only topology of H100s or H200s (`compile_train_step`), and readers of what it made:
memory per GPU, collectives, how much of their traffic is async and overlapped with compute,
the custom-call kernels (`read`), a step-time estimate walked from the schedule
(`estimate`), and the buffers live at the memory peak, from XLA's dump (`buffers`). Needs
the `gpu-aot` extra (JAX's CUDA plugin and a pip ptxas)."""

from moejax.aot.compile import GpuProgram, compile_train_step, xla_options
from moejax.aot.gpus import GPUS, Gpu, compile_only_devices, has_cuda_plugin, target_config

__all__ = ["GPUS", "Gpu", "GpuProgram", "compile_only_devices", "compile_train_step",
           "has_cuda_plugin", "target_config", "xla_options"]
