"""Which cached item leaves the device first when the memory pool needs room.

The candidates are device KV leaves of the prefix tree and idle adapters (reference count 0,
no device KV below them). A policy only orders them, least valuable first; the memory manager
decides who is a candidate and moves the bytes. Picked by name from `MEMORY_POLICY_CLASSES`.

`fastlibra` is FastLibra's cost model (see ../shared/papers/fastlibra.txt, section 5):
    Eval_i = LoRA_Eval_i * cost_i * prob_i * (1 - sigmoid(t_i))
cost_i the time to bring the item back over the link (proportional to its bytes), prob_i its
share of the visits of its kind, t_i the seconds since it was last used. LoRA_Eval =
max(1, Low_lora / Now_lora) for adapters, where Low_lora = sum_i (1 - (1 - p_i)^BS) is the
number of adapters a batch of the recent size BS is expected to need and Now_lora the number on
the device: while fewer adapters are cached than batches use, adapters weigh more. KV nodes take
LoRA_Eval = 1 (our choice: the paper's reward is about the number of adapters).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from toppings.gpu_lora.eviction import least_recently_used, make_by_name


class ItemKind(enum.Enum):
    """What a cached item of the pool is."""

    KV = "kv"  # a prefix-tree block
    ADAPTER = "adapter"  # an idle adapter's weights


@dataclass
class Candidate:
    """One item that may leave the device."""

    kind: ItemKind
    item: object  # the prefix-tree node, or the adapter's name
    num_bytes: int
    visits: int
    last_used: float  # monotonic seconds


@dataclass
class PoolContext:
    """What a policy may know of the pool as a whole."""

    now: float
    visits_by_kind: dict[ItemKind, int]  # total visits of each kind's items
    expected_adapters: float  # Low_lora: adapters a recent batch is expected to use
    cached_adapters: int  # Now_lora


class MemoryPolicy:
    name = "base"

    def order(self, candidates: list[Candidate], ctx: PoolContext) -> list[Candidate]:
        raise NotImplementedError


class LRUPolicy(MemoryPolicy):
    """Least recently used first, whatever its kind (vLLM's policy, as FastLibra's baseline)."""

    name = "lru"

    def order(self, candidates: list[Candidate], ctx: PoolContext) -> list[Candidate]:
        return least_recently_used(candidates)


class FastLibraPolicy(MemoryPolicy):
    """Lowest Eval first; see the module docstring."""

    name = "fastlibra"

    def value(self, c: Candidate, ctx: PoolContext) -> float:
        prob = c.visits / max(1, ctx.visits_by_kind.get(c.kind, 0))
        age = max(0.0, ctx.now - c.last_used)
        decay = 1.0 / (1.0 + math.exp(min(age, 700.0)))  # 1 - sigmoid(t), without cancellation
        lora_eval = 1.0
        if c.kind is ItemKind.ADAPTER:
            lora_eval = max(1.0, ctx.expected_adapters / max(1, ctx.cached_adapters))
        return lora_eval * c.num_bytes * prob * decay

    def order(self, candidates: list[Candidate], ctx: PoolContext) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (self.value(c, ctx), c.last_used))


MEMORY_POLICY_CLASSES: dict[str, type[MemoryPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    FastLibraPolicy.name: FastLibraPolicy,
}


def make_memory_policy(name: str) -> MemoryPolicy:
    return make_by_name(MEMORY_POLICY_CLASSES, name, "memory policy")


def expected_adapters(adapter_counts: dict[str, int], batch_size: float) -> float:
    """FastLibra's Low_lora = sum_i (1 - (1 - p_i)^BS) from each adapter's request count."""
    total = sum(adapter_counts.values())
    if not total:
        return 0.0
    return sum(1.0 - (1.0 - n / total) ** batch_size for n in adapter_counts.values())
