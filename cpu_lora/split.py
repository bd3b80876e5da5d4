"""Splitting a layer call's tokens over workers (Toppings §4, profiling-guided parallelisation).

A core is worth using for c tokens or more (c comes from the pool's profile), so a call with n
adapter tokens uses ceil(n / c) workers. The rows [0, T) are cut into that many contiguous
slices of about equal work, a token's work being proportional to its adapter's rank.
"""

from __future__ import annotations

import math

Segment = tuple[int, int, int, int]  # (adapter slot, start, end, rank)
Slice = tuple[int, int, list[tuple[int, int, int]]]  # (row_start, row_end, [(slot, start, end)])


def num_parts(work_tokens: int, tokens_per_core: int, max_parts: int) -> int:
    """ceil(work_tokens / c) workers, at least one, at most max_parts."""
    if work_tokens <= 0 or max_parts <= 0:
        return 0
    return max(1, min(max_parts, math.ceil(work_tokens / max(1, tokens_per_core))))


def split_rows(segments: list[Segment], num_tokens: int, parts: int) -> list[Slice]:
    """Cut rows [0, T) into at most `parts` contiguous slices of about equal rank-weighted work.

    Every row belongs to exactly one slice; each slice carries its segments clipped to its rows
    and holds some work (a slice that would hold none is merged into its neighbour).
    Segments must be sorted by start and must not overlap.
    """
    total = sum((end - start) * rank for _, start, end, rank in segments)
    if total == 0 or parts <= 0:
        return []
    cuts, done, k = [0], 0, 1
    for _, start, end, rank in segments:
        work = (end - start) * rank
        while k < parts and done + work >= k * total / parts:
            cut = start + math.ceil((k * total / parts - done) / rank)
            cut = min(max(cut, start), end)
            if cut > cuts[-1]:
                cuts.append(cut)
            k += 1
        done += work
    if cuts[-1] < num_tokens:
        cuts.append(num_tokens)
    slices: list[Slice] = []
    for lo, hi in zip(cuts, cuts[1:]):
        clipped = [(s, max(a, lo), min(b, hi)) for s, a, b, _ in segments if a < hi and b > lo]
        if not clipped and slices:
            prev_lo, _, prev_segs = slices[-1]
            slices[-1] = (prev_lo, hi, prev_segs)
        elif slices and not slices[-1][2]:
            slices[-1] = (slices[-1][0], hi, clipped)
        else:
            slices.append((lo, hi, clipped))
    return slices
