"""Resident adapters in the column-pool layout the LoRA kernels read.

For each targeted projection there is one tensor pair over all layers:
`lora_a[module]` [L, C_m, H_in] and `lora_b[module]` [L, C_m, H_out]. An adapter of rank r owns
the rows [offset, offset + r) in every layer of each projection it targets, so one
(offset, rank) pair locates it everywhere. Each projection has its own row allocator and its own
row count C_m: an adapter takes rows only in the projections it targets (adapters with disjoint
targets may share row indices), and the kernels, which skip a projection where a unit's rank is
0, never read a row of a projection its adapter does not target.

What an adapter occupies is `bytes_for(rank, targets)`: r rows in all L layers of each targeted
projection (an adapter on one layer still owns its rows in every layer). With `max_bytes` the
pool's tensors never hold more than that many bytes in all: growth is capped, and tensors are
cut to their last used row when that is what makes room.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.targets import LORA_TARGETS, ModelShapes


@dataclass(frozen=True)
class ResidentAdapter:
    """Where an adapter sits in the pool (`id`: the pool's key, `LoraAdapter.id`, also the host
    runner's; `name`: what logs and /stats show, never a key)."""

    name: str
    offset: int
    rank: int
    scale: float
    targets: frozenset[str]
    id: int = 0


class RowAllocator:
    """Used row ranges of one projection's tensors, which hold `capacity` rows."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._used: dict[int, int] = {}  # offset -> length

    def is_free(self, start: int, n: int) -> bool:
        """Whether no used range overlaps [start, start + n) (capacity not considered)."""
        return all(off + length <= start or start + n <= off for off, length in self._used.items())

    def take(self, start: int, n: int) -> None:
        self._used[start] = n

    def free(self, offset: int) -> None:
        del self._used[offset]

    def ends(self) -> list[int]:
        """Where each used range ends: the candidate starts of a first fit."""
        return [off + length for off, length in self._used.items()]

    @property
    def used_end(self) -> int:
        """One past the last used row (0 when none is used)."""
        return max(self.ends(), default=0)


@dataclass(frozen=True)
class _Plan:
    """Where an adapter would go and the row count each projection's tensors would have."""

    offset: int
    capacities: dict[str, int]  # module -> rows after the reservation (only those that change)


class AdapterPool:
    """The engine's adapter weights on its device, by adapter id; see the module docstring."""

    def __init__(
        self,
        config: ModelShapes,
        dtype: torch.dtype,
        device: str | torch.device,
        initial_rows: int = 128,
    ):
        """initial_rows: the rows a projection's tensors get when they are first made (fewer
        when a byte cap does not allow them)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.initial_rows = initial_rows
        self.rows: dict[str, RowAllocator] = {m: RowAllocator() for m in LORA_TARGETS}
        self.lora_a: dict[str, torch.Tensor] = {}  # module -> [L, C_m, H_in]
        self.lora_b: dict[str, torch.Tensor] = {}  # module -> [L, C_m, H_out]
        self.resident: dict[int, ResidentAdapter] = {}  # by LoraAdapter.id
        self._item = torch.empty((), dtype=dtype).element_size()
        # Moves whenever an adapter's rows or a projection's tensors may have: a step's LoRA
        # batch built before it (offsets, ranks, the tables' addresses) may be stale after.
        self.generation = 0

    # ---- sizes ------------------------------------------------------------------------------

    def row_bytes(self, module: str) -> int:
        """Bytes of one row of a projection: A and B^T in all L layers at the pool's dtype."""
        if module not in LORA_TARGETS:
            raise KeyError(f"unknown projection {module!r}")
        h_in, h_out = self.config.projection_shape(module)
        return self.config.num_layers * (h_in + h_out) * self._item

    def bytes_for(self, rank: int, modules: Iterable[str]) -> int:
        """Bytes an adapter of `rank` on `modules` occupies here (its charge)."""
        return rank * sum(self.row_bytes(m) for m in set(modules))

    def charge(self, adapter: LoraAdapter) -> int:
        """`bytes_for` of an adapter."""
        return self.bytes_for(adapter.rank, adapter.target_modules)

    @property
    def nbytes(self) -> int:
        """Bytes the pool's tensors hold now."""
        tensors = [*self.lora_a.values(), *self.lora_b.values()]
        return sum(t.nbytes for t in tensors)

    # ---- reservations -----------------------------------------------------------------------

    def can_reserve(self, adapter: LoraAdapter, max_bytes: int | None = None) -> bool:
        """Whether `reserve` would find rows for it with the pool at most `max_bytes`."""
        return self._plan(adapter, max_bytes) is not None

    def must_grow(self, adapter: LoraAdapter, max_bytes: int | None = None) -> bool:
        """Whether reserving it reallocates tensors (which a running load must not see)."""
        plan = self._plan(adapter, max_bytes)
        return plan is not None and bool(plan.capacities)

    def add(self, adapter: LoraAdapter, max_bytes: int | None = None) -> ResidentAdapter:
        """Reserve rows for an adapter and copy it in, here and now."""
        entry = self.reserve(adapter, max_bytes)
        end = entry.offset + adapter.rank
        for (layer, module), (a, b) in adapter.weights.items():
            self.lora_a[module][layer, entry.offset : end].copy_(a)  # A [r, H_in]
            self.lora_b[module][layer, entry.offset : end].copy_(b.t())  # B^T [r, H_out]
        return entry

    def reserve(self, adapter: LoraAdapter, max_bytes: int | None = None) -> ResidentAdapter:
        """Take rows for an adapter (reallocating tensors if needed, the pool staying at most
        `max_bytes`); its rows still hold zeros. Raises MemoryError when it cannot fit."""
        if adapter.id in self.resident:
            raise KeyError(f"adapter {adapter.name!r} (id {adapter.id}) is already resident")
        plan = self._plan(adapter, max_bytes)
        if plan is None:
            raise MemoryError(
                f"adapter {adapter.name!r} ({self.charge(adapter)} bytes) does not fit in the "
                f"adapter pool of at most {max_bytes} bytes"
            )
        self.generation += 1
        for module, capacity in plan.capacities.items():
            self._resize(module, capacity)
        for module in adapter.target_modules:
            self.rows[module].take(plan.offset, adapter.rank)
        entry = ResidentAdapter(
            adapter.name,
            plan.offset,
            adapter.rank,
            adapter.scale,
            frozenset(adapter.target_modules),
            adapter.id,
        )
        self.resident[adapter.id] = entry
        return entry

    def compact(self, fixed: frozenset[int] = frozenset()) -> dict[int, ResidentAdapter]:
        """Slide resident adapters down to the lowest rows free in all their projections, in
        order of their offsets, so that free rows gather at the end: a budget with room for an
        adapter in bytes then has it in rows too. Adapters in `fixed` (a load is writing their
        rows) stay. Returns the adapters moved at their new places, by name; their rows are
        copied here, in order on the device's stream with the steps before and after; both
        by adapter id."""
        moved = {}
        for entry in sorted(self.resident.values(), key=lambda e: e.offset):
            if entry.id in fixed:
                continue
            rows = [self.rows[m] for m in entry.targets]
            for allocator in rows:
                allocator.free(entry.offset)
            starts = {0, entry.offset, *(end for a in rows for end in a.ends())}
            new = min(s for s in starts if s <= entry.offset
                      and all(a.is_free(s, entry.rank) for a in rows))  # fmt: skip
            for allocator in rows:
                allocator.take(new, entry.rank)
            if new != entry.offset:
                self.generation += 1
                self._move_rows(entry, new)
                moved[entry.id] = self.resident[entry.id] = replace(entry, offset=new)
        return moved

    def _move_rows(self, entry: ResidentAdapter, new: int) -> None:
        """Copy an adapter's rows down to `new` (< its offset) in chunks no longer than the
        shift, so no chunk reads a row an earlier one wrote, and zero the rows it leaves."""
        old, rank = entry.offset, entry.rank
        shift = old - new
        for module in entry.targets:
            for table in (self.lora_a[module], self.lora_b[module]):  # [L, C_m, H]
                for k in range(0, rank, shift):
                    n = min(shift, rank - k)
                    table[:, new + k : new + k + n] = table[:, old + k : old + k + n]
                table[:, max(old, new + rank) : old + rank].zero_()

    def rename(self, adapter_id: int, name: str) -> ResidentAdapter:
        """The adapter of this id now goes by `name` (its rows serve several names and the one
        it had was unloaded): /stats and logs show a name still registered (nothing looks it up
        by name)."""
        self.generation += 1
        entry = self.resident[adapter_id] = replace(self.resident[adapter_id], name=name)
        return entry

    def remove(self, adapter_id: int) -> None:
        """Free the rows of the adapter of this id (zeroed)."""
        self.generation += 1
        entry = self.resident.pop(adapter_id)
        for module in entry.targets:
            self.rows[module].free(entry.offset)
            # Zero the rows so a layer the adapter did not cover can never leak into another.
            self.lora_a[module][:, entry.offset : entry.offset + entry.rank].zero_()
            self.lora_b[module][:, entry.offset : entry.offset + entry.rank].zero_()

    def _plan(self, adapter: LoraAdapter, max_bytes: int | None) -> _Plan | None:
        """Where `reserve` puts an adapter: at an offset aligned to its rank rounded up to a
        power of two where that meets the cap, else anywhere (`_plan_at`). Aligned, adapters
        pack like a buddy allocator's blocks: a small one never sits where it splits the rows
        a large one needs, so a budget that holds two rank-128 adapters holds them once the
        idle small ones are evicted (placed first fit after a rank-8 one, the first left no
        128 free rows in a row: the second waited for it to end, 2.2 s at light load in
        bench_queueing)."""
        for module in adapter.target_modules:
            if module not in LORA_TARGETS:
                raise KeyError(f"unknown projection {module!r}")
        align = 1 << max(adapter.rank - 1, 0).bit_length()
        plan = self._plan_at(adapter, max_bytes, align)
        if plan is None and align > 1:
            plan = self._plan_at(adapter, max_bytes, 1)
        return plan

    def _plan_at(self, adapter: LoraAdapter, max_bytes: int | None, align: int) -> _Plan | None:
        """First fit over the targeted projections' rows at offsets that are multiples of
        `align`: an offset inside their tensors as they are if one is free, else the first free
        one past that, with the tensors grown (doubling when the cap allows it, else exactly)
        and, if the cap needs it, every projection's tensors cut to their last used row. None
        when the cap cannot be met."""
        rank, modules = adapter.rank, adapter.target_modules
        ends = {0, *(end for m in modules for end in self.rows[m].ends())}
        starts = sorted({-(-end // align) * align for end in ends})
        free = [s for s in starts if all(self.rows[m].is_free(s, rank) for m in modules)]
        inside = [s for s in free if all(s + rank <= self.rows[m].capacity for m in modules)]
        if inside:
            return _Plan(inside[0], {})
        offset, end = free[0], free[0] + rank  # past the last used row of some target: always free
        needed = {m: end for m in modules if self.rows[m].capacity < end}
        roomy = {m: max(end, 2 * self.rows[m].capacity, self.initial_rows) for m in needed}
        for grown, trim in ((roomy, False), (needed, False), (needed, True)):
            capacities = dict(grown)
            if trim:
                for module, rows in self.rows.items():
                    if module in self.lora_a:
                        cut = max(rows.used_end, end if module in modules else 0)
                        capacities[module] = max(cut, capacities.get(module, 0))
            changed = {
                m: c
                for m, c in capacities.items()
                if m not in self.lora_a or c != self.rows[m].capacity
            }
            if max_bytes is None or self._bytes_with(changed) <= max_bytes:
                return _Plan(offset, changed)
        return None

    def _bytes_with(self, capacities: dict[str, int]) -> int:
        """Bytes of the pool's tensors if these projections had these row counts."""
        rows = {m: r.capacity for m, r in self.rows.items() if m in self.lora_a}
        rows.update(capacities)
        return sum(n * self.row_bytes(m) for m, n in rows.items())

    def _resize(self, module: str, capacity: int) -> None:
        """Reallocate a projection's tensors to `capacity` rows, keeping the rows in use."""
        keep = min(capacity, self.rows[module].capacity)
        if keep < self.rows[module].used_end:
            raise RuntimeError(f"{module}: cutting to {capacity} rows would drop rows in use")
        self.generation += 1
        h_in, h_out = self.config.projection_shape(module)
        for table, width in ((self.lora_a, h_in), (self.lora_b, h_out)):
            bigger = torch.zeros(
                self.config.num_layers, capacity, width, dtype=self.dtype, device=self.device
            )
            old = table.get(module)
            if old is not None:
                bigger[:, :keep] = old[:, :keep]
            table[module] = bigger
        self.rows[module].capacity = capacity
