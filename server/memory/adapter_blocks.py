"""Blocks of the KV pool charged to adapter weights (the pool layout's `AdapterBudget`).

An adapter is charged ceil(bytes / block bytes) blocks while it is on the device, its bytes being
what it occupies in the adapter pool (`AdapterPool.bytes_for`), charged before the pool allocates
its rows. The weights themselves sit in the adapter pool's tensors: the blocks only keep KV from
using that memory. Taking blocks never evicts: the reclaimer (reclaim.py, the node's one owner
of eviction) frees them first, at admission.
"""

from __future__ import annotations

from collections.abc import Callable

from toppings.server.memory.kv_cache import KVPool

# () -> blocks of the pool not promised to anyone (MemoryManager: all but the committed ones).
Unpromised = Callable[[], int]


class AdapterBlocks:
    """Which pool blocks each adapter on the device is charged, by adapter id; see the module
    docstring."""

    def __init__(self, kv: KVPool, unpromised: Unpromised):
        self.kv = kv
        self.unpromised = unpromised
        self.blocks: dict[int, list[int]] = {}  # adapter id -> its blocks

    def blocks_for_bytes(self, num_bytes: int) -> int:
        return -(-num_bytes // self.kv.block_bytes)

    def take(self, adapter_id: int, num_bytes: int, promised: bool = True) -> bool:
        """Charge an adapter's blocks from the free ones; `promised` (a request's load, which
        admission counted in its promises): any free block; else (a prefetch) only blocks that
        no admitted request was promised: its load cannot be evicted to give them back while
        it runs."""
        need = self.blocks_for_bytes(num_bytes)
        if need > self.kv.num_free_blocks or (not promised and need > self.unpromised()):
            return False
        self.blocks[adapter_id] = self.kv.alloc_blocks(need)
        return True

    def give(self, adapter_id: int) -> None:
        self.kv.free_blocks(self.blocks.pop(adapter_id, ()))

    def capacity_bytes(self) -> int:
        """Bytes of the whole pool: the most adapters could be charged, with no KV at all."""
        return self.kv.num_blocks * self.kv.block_bytes

    def num_blocks_of(self, adapter_ids: list[int]) -> int:
        """Blocks charged to the adapters of these ids (0 for one not charged)."""
        blocks = self.blocks
        return sum(len(blocks.get(i, ())) for i in adapter_ids)

    def num_blocks(self) -> int:
        """Blocks charged to all adapters (one copy of the table: any thread)."""
        return sum(len(b) for b in list(self.blocks.values()))
