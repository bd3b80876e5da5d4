"""Resident adapters in the column-pool layout the LoRA kernels read.

For each targeted projection there is one tensor pair over all layers:
`lora_a[module]` [L, C, H_in] and `lora_b[module]` [L, C, H_out]. An adapter of rank r owns the
same rows [offset, offset + r) in every projection and layer (rows of projections it does not
target stay unused), so one (offset, rank) pair locates it everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toppings.gpu_lora.peft_format import LoraAdapter
from toppings.gpu_lora.targets import LORA_TARGETS, ModelShapes


@dataclass(frozen=True)
class ResidentAdapter:
    """Where an adapter sits in the pool."""

    name: str
    offset: int
    rank: int
    scale: float
    targets: frozenset[str]


class RowAllocator:
    """First-fit allocation of row ranges in [0, capacity)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._used: dict[int, int] = {}  # offset -> length

    def alloc(self, n: int) -> int | None:
        """Offset of a free range of n rows, or None when none is free."""
        start = self._first_fit(n)
        if start is not None:
            self._used[start] = n
        return start

    def can_alloc(self, n: int) -> bool:
        return self._first_fit(n) is not None

    def _first_fit(self, n: int) -> int | None:
        start = 0
        for off in sorted(self._used):
            if off - start >= n:
                break
            start = max(start, off + self._used[off])
        return None if start + n > self.capacity else start

    def free(self, offset: int) -> None:
        del self._used[offset]

    def grow(self, capacity: int) -> None:
        self.capacity = max(self.capacity, capacity)


class AdapterPool:
    """The engine's adapter weights on its device, by name."""

    def __init__(
        self,
        config: ModelShapes,
        dtype: torch.dtype,
        device: str | torch.device,
        initial_rows: int = 128,
    ):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.rows = RowAllocator(initial_rows)
        self.lora_a: dict[str, torch.Tensor] = {}  # module -> [L, C, H_in]
        self.lora_b: dict[str, torch.Tensor] = {}  # module -> [L, C, H_out]
        self.resident: dict[str, ResidentAdapter] = {}

    def add(self, adapter: LoraAdapter) -> ResidentAdapter:
        """Reserve rows for an adapter and copy it in, here and now."""
        entry = self.reserve(adapter)
        end = entry.offset + adapter.rank
        for (layer, module), (a, b) in adapter.weights.items():
            self.lora_a[module][layer, entry.offset : end].copy_(a)  # A [r, H_in]
            self.lora_b[module][layer, entry.offset : end].copy_(b.t())  # B^T [r, H_out]
        return entry

    def reserve(self, adapter: LoraAdapter) -> ResidentAdapter:
        """Take rows for an adapter (growing the pool if needed); its rows still hold zeros."""
        if adapter.name in self.resident:
            raise KeyError(f"adapter {adapter.name!r} is already resident")
        offset = self.rows.alloc(adapter.rank)
        if offset is None:
            self._grow(max(2 * self.rows.capacity, self.rows.capacity + adapter.rank))
            offset = self.rows.alloc(adapter.rank)
        for module in adapter.target_modules:
            self._ensure_module(module)
        entry = ResidentAdapter(
            adapter.name, offset, adapter.rank, adapter.scale, frozenset(adapter.target_modules)
        )
        self.resident[adapter.name] = entry
        return entry

    def remove(self, name: str) -> None:
        entry = self.resident.pop(name)
        self.rows.free(entry.offset)
        for module in entry.targets:
            # Zero the rows so a layer the adapter did not cover can never leak into another.
            self.lora_a[module][:, entry.offset : entry.offset + entry.rank].zero_()
            self.lora_b[module][:, entry.offset : entry.offset + entry.rank].zero_()

    def _ensure_module(self, module: str) -> None:
        if module in self.lora_a:
            return
        if module not in LORA_TARGETS:
            raise KeyError(f"unknown projection {module!r}")
        h_in, h_out = self.config.projection_shape(module)
        shape = (self.config.num_layers, self.rows.capacity)
        self.lora_a[module] = torch.zeros(*shape, h_in, dtype=self.dtype, device=self.device)
        self.lora_b[module] = torch.zeros(*shape, h_out, dtype=self.dtype, device=self.device)

    def _grow(self, capacity: int) -> None:
        old = self.rows.capacity
        self.rows.grow(capacity)
        for table in (self.lora_a, self.lora_b):
            for module, t in table.items():
                bigger = t.new_zeros(t.shape[0], capacity, t.shape[2])
                bigger[:, :old] = t
                table[module] = bigger
