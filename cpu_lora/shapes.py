"""Projection names, module bitmasks, dtypes and the shape interface cpu_lora needs.

cpu_lora knows nothing of the server: the projection names and the model-shapes protocol come
from `gpu_lora.targets` (the server's ModelConfig fits it), and an adapter is anything shaped like
gpu_lora's LoraAdapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from toppings.gpu_lora.targets import LORA_TARGETS, ModelShapes

DTYPES = {0: torch.float32, 1: torch.bfloat16}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}


class AdapterLike(Protocol):
    """gpu_lora.peft.adapter.LoraAdapter: weights[(layer, module)] = (A [R, H_in], B [H_out, R]).
    `id` is what the repository keys it by; `name` appears in messages only."""

    id: int
    name: str
    rank: int
    scale: float
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_mask(modules: Iterable[str]) -> int:
    """Bitmask of projection names (bit i = LORA_TARGETS[i]); raises KeyError on unknown names."""
    mask = 0
    for module in modules:
        if module not in LORA_TARGETS:
            raise KeyError(f"unknown projection {module!r}; targets are {', '.join(LORA_TARGETS)}")
        mask |= 1 << LORA_TARGETS.index(module)
    return mask


def mask_modules(mask: int) -> tuple[str, ...]:
    """Projection names in a bitmask, in LORA_TARGETS order."""
    return tuple(m for i, m in enumerate(LORA_TARGETS) if mask >> i & 1)


def all_shapes(model: ModelShapes) -> tuple[tuple[int, int], ...]:
    """(H_in, H_out) of every projection, in LORA_TARGETS order."""
    return tuple(tuple(model.projection_shape(m)) for m in LORA_TARGETS)
