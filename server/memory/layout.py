"""How the node's device memory is split between KV and adapters (`--memory-layout`).

The layout is resolved once, from the configuration, into one of the classes below (picked from
`LAYOUTS` by its `MemoryLayout`); everything that depends on it asks the object instead of
comparing names:
- `pool` (ELORA/FastLibra, Chameleon's idle-memory cache): one budget of blocks for KV and
  adapter weights (see manager.py).
- `static`: `max_total_tokens` of KV and the adapter cache's own byte budget, kept to compare
  with.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

from toppings.server.config import AUTO_EVICTION, MemoryConfig

POOL_SHARE_OF_FREE = 0.4  # CUDA: the memory pool's default share of the free device memory


class MemoryLayout(enum.Enum):
    POOL = "pool"
    STATIC = "static"


class KVShape(Protocol):
    """The part of the model configuration the size of a KV slot depends on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_slot_bytes(model: KVShape, itemsize: int) -> int:
    """Bytes of one token's K and V over all layers, at `itemsize` bytes an element."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * itemsize


class Layout:
    """What the memory side asks of its layout; one subclass per `MemoryLayout`.

    memory: the memory part of the engine's configuration; device: "cpu" or "cuda";
    adapter_cache_bytes: the adapter cache's byte budget (the LoRA part's; 0: no limit).
    """

    kind: MemoryLayout
    # The eviction policy `--eviction auto` means here (gpu_lora/eviction.py's table).
    default_eviction: str

    def __init__(self, memory: MemoryConfig, device: str, adapter_cache_bytes: int):
        self.memory = memory
        self.device = device
        self.adapter_cache_bytes = adapter_cache_bytes

    def kv_slots(self, model: KVShape, itemsize: int, free_device_bytes: Callable[[], int]) -> int:
        """KV token slots of the engine. itemsize: bytes per KV element; free_device_bytes:
        () -> free bytes of the device (asked only on CUDA without a budget)."""
        raise NotImplementedError

    def charges_adapters(self) -> bool:
        """Whether adapter weights take blocks of the KV pool."""
        raise NotImplementedError

    def eviction(self) -> str:
        """The name of the eviction policy of `EVICTION_POLICIES` that orders what leaves the
        device, adapters and KV alike (`--eviction`; auto: the layout's default)."""
        name = self.memory.eviction
        return self.default_eviction if name == AUTO_EVICTION else name

    def adapter_memory_is_scarce(self) -> bool:
        """Whether an adapter's weights compete for memory admission should count."""
        raise NotImplementedError

    def total_tokens(self, num_slots: int, slot_bytes: float) -> int:
        """All the node's device memory for requests, in KV tokens of `slot_bytes` each."""
        raise NotImplementedError


class PoolLayout(Layout):
    """One budget for KV and adapters (memory_bytes; see MemoryConfig for its defaults)."""

    kind = MemoryLayout.POOL
    default_eviction = "fastlibra"  # FastLibra's cost model, KV and adapters in one pool

    def kv_slots(self, model: KVShape, itemsize: int, free_device_bytes: Callable[[], int]) -> int:
        cfg = self.memory
        slot_bytes = kv_slot_bytes(model, itemsize)
        budget = cfg.memory_bytes
        if not budget and self.device == "cuda":
            # Adapter weights sit in their own tensors beside the KV ones: leave them as much
            # again as the pool.
            budget = int(POOL_SHARE_OF_FREE * free_device_bytes())
        elif not budget:
            budget = cfg.max_total_tokens * slot_bytes + self.adapter_cache_bytes
        return max(budget // slot_bytes, cfg.block_tokens)

    def charges_adapters(self) -> bool:
        # Without any budget on a CPU adapters are not charged: no limit, as with no cache budget.
        return bool(self.memory.memory_bytes or self.adapter_cache_bytes or self.device == "cuda")

    def adapter_memory_is_scarce(self) -> bool:
        return self.charges_adapters()

    def total_tokens(self, num_slots: int, slot_bytes: float) -> int:
        return num_slots


class StaticLayout(Layout):
    """max_total_tokens of KV; adapters in the cache's own adapter_cache_bytes (0: no limit)."""

    kind = MemoryLayout.STATIC
    default_eviction = "lru"  # what its adapter cache always used

    def kv_slots(self, model: KVShape, itemsize: int, free_device_bytes: Callable[[], int]) -> int:
        return self.memory.max_total_tokens

    def charges_adapters(self) -> bool:
        return False

    def adapter_memory_is_scarce(self) -> bool:
        return bool(self.adapter_cache_bytes)

    def total_tokens(self, num_slots: int, slot_bytes: float) -> int:
        return num_slots + int(self.adapter_cache_bytes // slot_bytes)


LAYOUTS: dict[MemoryLayout, type[Layout]] = {
    MemoryLayout.POOL: PoolLayout,
    MemoryLayout.STATIC: StaticLayout,
}


def make_layout(
    name: str, memory: MemoryConfig, *, device: str, adapter_cache_bytes: int
) -> Layout:
    """The layout named `name` ("pool" or "static"; the engine's is `memory.memory_layout`)
    over the memory part, the device and the adapter cache's byte budget (0: no limit)."""
    return LAYOUTS[MemoryLayout(name)](memory, device, adapter_cache_bytes)
