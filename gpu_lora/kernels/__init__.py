"""Multi-LoRA kernels over the column pool: BGMV (Punica) and MBGMV (S-LoRA), decode and prefill.

Every implementation ships the same four functions with the same signatures; their semantics,
shapes and dtypes are documented in `gpu_lora.kernels.reference`, the float32 oracle:

    bgmv_decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank)
    mbgmv_decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank=None)
    bgmv_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank)
    mbgmv_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank=None)

All add into y in place and return None. Implementations: "reference" (torch loops, the oracle),
"cpu" (the CPU engine's torch path), "triton" (the device kernels; on CPU tensors they need
TRITON_INTERPRET=1) and `native` (MBGMV over runs in C, the CPU engine's MBGMV where a compiler
is found; built by `native_build`). `backend.select(kernel, device, dtype)` is the one place that
picks an engine's `LoraBackend` among them; `backend.get_kernels(name)` names one for tests and
benchmarks. Only the Triton modules import triton, and only when that implementation is asked
for. `cpu.lora_rows` is the host's x @ A.T @ B^T of one adapter's tokens, shared by the
in-process host path and the CPU workers.
"""

from __future__ import annotations

from toppings.gpu_lora.kernels.backend import (
    BACKENDS,
    KernelFunctions,
    LoraBackend,
    LoraKernel,
    get_kernels,
    select,
)

__all__ = ["BACKENDS", "KernelFunctions", "LoraBackend", "LoraKernel", "get_kernels", "select"]
