"""Attention over the token-level KV pool in Triton, reading each key and value row by its slot
inside the kernel: the GPU's path (`model.attention` imports this room only on a GPU, so a
machine without Triton still runs the server). `decode`: one query per request, flash-decoding
with splits; `prefill`: a prefill or mixed step's segments in one launch per layer.
"""

from __future__ import annotations

from toppings.server.model.paged.decode import num_splits, paged_decode_attention
from toppings.server.model.paged.prefill import PagedPrefill, paged_prefill_attention, plan_paged

__all__ = [
    "PagedPrefill",
    "num_splits",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_paged",
]
