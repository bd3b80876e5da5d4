"""Activated LoRA (PEFT's `alora_invocation_tokens`): the adapter applies only from its
invocation sequence on.

PEFT (peft/tuners/lora/variants.py, `calculate_alora_offsets` and `ALoraLinearVariant`) finds
the *last* occurrence of the invocation token sequence in the prompt; the LoRA delta is added to
the tokens from the start of that occurrence on (the invocation tokens themselves included) and
to every generated token, and the tokens before it are the base model's alone. A prompt without
the sequence gets no delta anywhere in PEFT; a server refuses it instead (the adapter would
silently be the base model).

The engine turns that into token ranges per step: `split_rows` cuts each request's rows of a
step at its activation position, so the LoRA kernels and the host workers never see the rows
before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def activation_start(prompt_ids: Sequence[int], invocation: Sequence[int]) -> int | None:
    """Where the last occurrence of `invocation` starts in `prompt_ids` (None: absent)."""
    n = len(invocation)
    first = invocation[0]
    for start in range(len(prompt_ids) - n, -1, -1):
        if prompt_ids[start] == first and list(prompt_ids[start : start + n]) == list(invocation):
            return start
    return None


def split_rows(
    items: list[T | None], seg_starts: list[int], positions: list[int], lora_starts: list[int]
) -> tuple[list[T | None], list[int]]:
    """Cut each request's rows at the position its adapter starts to apply.

    items: per request B its adapter (None: base model); seg_starts [B + 1]: its rows of the
    step; positions [B]: the position of its first row; lora_starts [B]: the first position
    the adapter applies to (0: all). Returns (pieces' items, pieces' row boundaries): a request
    whose rows straddle its start becomes a base piece then an adapter piece; one wholly before
    it, a base piece; no piece is empty."""
    out_items: list[T | None] = []
    out_starts: list[int] = [seg_starts[0]]
    for i, item in enumerate(items):
        lo, hi = seg_starts[i], seg_starts[i + 1]
        cut = min(max(lora_starts[i] - positions[i], 0), hi - lo) if item is not None else 0
        if cut == 0:
            out_items.append(item)
            out_starts.append(hi)
            continue
        out_items.append(None)
        out_starts.append(lo + cut)
        if lo + cut < hi:
            out_items.append(item)
            out_starts.append(hi)
    return out_items, out_starts
