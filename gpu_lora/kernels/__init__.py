"""Multi-LoRA kernels over the column pool: BGMV (Punica) and MBGMV (S-LoRA), decode and prefill.

Every backend ships the same four functions with the same signatures; their semantics, shapes and
dtypes are documented in `gpu_lora.kernels.reference`, the float32 oracle:

    bgmv_decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank)
    mbgmv_decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank=None)
    bgmv_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank)
    mbgmv_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank=None)

All add into y in place and return None. Backends: "reference" (torch loops, the oracle), "cpu"
(the CPU engine's fast path) and "triton" (the device kernels; on CPU tensors they need
TRITON_INTERPRET=1). Only the Triton modules import triton, and only when that backend is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

_PKG = "toppings.gpu_lora.kernels"
BACKENDS = {
    "reference": (f"{_PKG}.reference", f"{_PKG}.reference"),
    "cpu": (f"{_PKG}.cpu", f"{_PKG}.cpu"),
    "triton": (f"{_PKG}.triton_decode", f"{_PKG}.triton_prefill"),
}


class LoraKernels(NamedTuple):
    """The four kernels of one backend."""

    bgmv_decode: Callable[..., None]
    mbgmv_decode: Callable[..., None]
    bgmv_prefill: Callable[..., None]
    mbgmv_prefill: Callable[..., None]

    @property
    def table(self) -> dict[tuple[str, str], Callable[..., None]]:
        """KERNELS[(kernel, phase)], kernel in {"bgmv", "mbgmv"}, phase in {"decode", "prefill"}."""
        return {
            (kernel, phase): getattr(self, f"{kernel}_{phase}")
            for kernel in ("bgmv", "mbgmv")
            for phase in ("decode", "prefill")
        }


def get_kernels(backend: str) -> LoraKernels:
    """The kernels of backend "reference", "cpu" or "triton" (imports that backend's modules)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {sorted(BACKENDS)}")
    decode_mod, prefill_mod = (importlib.import_module(name) for name in BACKENDS[backend])
    return LoraKernels(
        decode_mod.bgmv_decode,
        decode_mod.mbgmv_decode,
        prefill_mod.bgmv_prefill,
        prefill_mod.mbgmv_prefill,
    )
