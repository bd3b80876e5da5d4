"""Counters of the memory side, shared by its managers (read by /stats and /metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryCounters:
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    swaps_in: int = 0
    swaps_out: int = 0
    evictions_kv: int = 0
    evictions_adapter: int = 0
