"""CPU decode path: the batch's LoRA as one masked dense matmul pair per projection.

On a CPU a per-adapter loop costs more in Python and op dispatch than in arithmetic, so a decode
step gathers the rows of every adapter in the batch once (a view when they are contiguous in the
pool), computes `h = x @ A_rows.T` for all tokens, zeroes each token's columns that are not its
adapter's (scaling the rest), and adds `h @ B_rows`. The plan (rows and mask) is built once per
step and reused by every layer, since offsets are the same in all layers.

BGMV keeps its padding: each adapter is read over the batch's max rank (rows past its rank are
masked to zero), so its cost grows with |adapters| x max rank as the perf model says; MBGMV reads
each adapter over its own rank. Relies on AdapterPool keeping rows of no adapter at zero and on
validated (finite) adapter weights, so masked columns contribute exactly zero. The general CPU
kernels (`kernels/cpu.py`, no such assumption) serve prefill and decode with loads in flight; its
docstring has the measured trade-off between the two.
"""

from __future__ import annotations

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool, ResidentAdapter


class DenseDecodePlan:
    """Rows and scale mask of each projection for one decode step of B requests."""

    def __init__(self, pool: AdapterPool, adapters: list[ResidentAdapter | None], padded: bool):
        self.pool = pool
        self._plans: dict[str, tuple[slice | torch.Tensor, torch.Tensor]] = {}
        capacity = pool.rows.capacity
        for module in pool.lora_a:
            users = [a if a is not None and module in a.targets else None for a in adapters]
            distinct = sorted({a for a in users if a is not None}, key=lambda a: a.offset)
            if not distinct:
                continue
            max_rank = max(a.rank for a in distinct)
            cols, ranges, width_total = {}, [], 0
            for a in distinct:
                width = min(max_rank, capacity - a.offset) if padded else a.rank
                cols[a.name] = width_total
                ranges.append((a.offset, a.offset + width))
                width_total += width
            mask = torch.zeros(len(adapters), width_total)  # [B, R_tot]
            for i, a in enumerate(users):
                if a is not None:
                    mask[i, cols[a.name] : cols[a.name] + a.rank] = a.scale
            self._plans[module] = (_rows(ranges), mask.to(pool.device, pool.dtype))

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self._plans)

    def add(self, module: str, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += LoRA delta of every token; x [B, H_in], y [B, H_out] (may be a view), in place."""
        plan = self._plans.get(module)
        if plan is None:
            return
        rows, mask = plan
        a = self.pool.lora_a[module][layer][rows]  # [R_tot, H_in]
        b = self.pool.lora_b[module][layer][rows]  # [R_tot, H_out]
        h = (x @ a.T) * mask  # [B, R_tot]
        y += h @ b


def _rows(ranges: list[tuple[int, int]]) -> slice | torch.Tensor:
    """A slice when the ranges tile one contiguous span (a view, no copy), else an index."""
    if all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:])):
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(lo, hi) for lo, hi in ranges])
