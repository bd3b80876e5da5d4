"""One owner of eviction decides for adapters in both memory layouts.

The reclaimer holds the node's one `Eviction` table, in the static layout (adapters in the
cache's own byte budget) as in the pool layout (KV and adapters in one pool): the same policy
name orders the same idle adapters alike in both, and `--eviction` (old name
`--memory-policy`) picks it. The adapter cache only offers candidates: admission asks the
memory to make room, then the cache allocates.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_lora.test_cache import CONFIG, adapter
from toppings.gpu_lora.eviction import EVICTION_POLICIES, FastLibraPolicy, LRUPolicy
from toppings.server.cli_args import build_parser, parse_configs
from toppings.server.config import EngineConfig, LoraConfig, MemoryConfig
from toppings.server.memory.build import build_memory

# (name, rank, uses): sizes, frequencies and recency that the three policies order differently.
ADAPTERS = (("big_rare", 16, 1), ("small_hot", 2, 5), ("mid_warm", 8, 2), ("small_cold", 2, 1))


def build(engine: EngineConfig):
    return build_memory(engine.part(MemoryConfig), engine.part(LoraConfig), "cpu", 4, CONFIG,
                        torch.float32, 256, lambda: 0)  # fmt: skip


def layouts(policy: str) -> dict[str, object]:
    """The memory of each layout, large enough for every adapter, no prefix cache (adapters
    are the only candidates), with `policy`."""
    common = dict(eviction=policy, prefix_cache=False, link_gbps=0.0)
    return {
        "static": build(
            EngineConfig(memory_layout="static", adapter_cache_bytes=1 << 24, **common)
        ),  # fmt: skip
        "pool": build(EngineConfig(memory_layout="pool", memory_bytes=1 << 24, **common)),
    }


def use_adapters(memories: dict[str, object]) -> None:
    """Each adapter is used `uses` times (the same calls on every memory, interleaved, so the
    recency of each adapter is the same relative order in each), then left idle."""
    loaded = {name: adapter(name, rank, seed=i) for i, (name, rank, _) in enumerate(ADAPTERS)}
    for name, _, uses in ADAPTERS:
        for _ in range(uses):
            for memory in memories.values():
                cache = memory.adapter_cache
                assert memory.make_adapter_room(loaded[name], frozenset())
                entry = cache.acquire(loaded[name])
                assert entry is not None and entry.ticket.wait(10)
                cache.release(loaded[name].id)


@pytest.mark.parametrize("policy", list(EVICTION_POLICIES))
def test_the_same_policy_orders_idle_adapters_alike_in_both_layouts(policy):
    memories = layouts(policy)
    try:
        use_adapters(memories)
        static = [c.name for c in memories["static"].reclaimer.adapter_order()]
        pool = [c.name for c in memories["pool"].reclaimer.order()]
        assert sorted(static) == sorted(name for name, _, _ in ADAPTERS)
        assert static == pool
        assert not memories["static"].reclaimer.order()  # adapters take no blocks there
        for memory in memories.values():
            assert type(memory.reclaimer.eviction.policy) is EVICTION_POLICIES[policy]
            assert not hasattr(memory.adapter_cache, "eviction")
        if policy == "lru":  # used last to first: small_cold went last
            assert static == ["big_rare", "small_hot", "mid_warm", "small_cold"]
    finally:
        for memory in memories.values():
            memory.adapter_cache.loader.close()


def test_auto_is_the_layouts_own_policy_and_memory_policy_names_the_same_flag():
    memories = layouts("auto")
    try:
        assert type(memories["static"].reclaimer.eviction.policy) is LRUPolicy
        assert type(memories["pool"].reclaimer.eviction.policy) is FastLibraPolicy
    finally:
        for memory in memories.values():
            memory.adapter_cache.loader.close()
    parser = build_parser()
    for flag in ("--eviction", "--memory-policy"):
        args = parser.parse_args(["--model", "m", flag, "chameleon"])
        assert parse_configs(args)[1].eviction == "chameleon"
    assert parse_configs(parser.parse_args(["--model", "m"]))[1].eviction == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--eviction", "fifo"])


def pool_of(num_adapters: int, policy: str):
    """A pool layout whose blocks hold `num_adapters` rank-8 adapters and nothing more."""
    probe = build(EngineConfig(memory_layout="pool", memory_bytes=1 << 24, prefix_cache=False))
    need = probe.blocks_for_bytes(probe.adapter_cache.charge(adapter("x", 8)))
    probe.adapter_cache.loader.close()
    nbytes = num_adapters * need * probe.kv.block_bytes
    engine = EngineConfig(memory_layout="pool", memory_bytes=nbytes, eviction=policy,
                          prefix_cache=False, link_gbps=0.0)  # fmt: skip
    return build(engine), need


def test_admission_makes_room_then_the_cache_only_allocates():
    """Pool layout, full of idle adapters: the cache alone evicts nothing and refuses the load;
    the owner evicts in the table's order (least recently used first), then the load takes the
    freed blocks; every block comes back when the adapters go."""
    memory, need = pool_of(2, "lru")
    cache, kv = memory.adapter_cache, memory.kv
    try:
        loras = [adapter(n, 8, seed=i) for i, n in enumerate(("old", "new", "third"))]
        for lora in loras[:2]:
            assert memory.make_adapter_room(lora, frozenset())
            assert cache.acquire(lora).ticket.wait(10)
            cache.release(lora.id)
        assert kv.num_free_blocks < need
        assert cache.acquire(loras[2]) is None  # allocation only allocates
        assert cache.counters.evictions == 0 and memory.counters.evictions_adapter == 0
        assert [c.name for c in memory.reclaimer.order()] == ["old", "new"]
        assert memory.make_adapter_room(loras[2], frozenset())
        assert not cache.holds(loras[0].id) and cache.holds(loras[1].id)
        assert memory.counters.evictions_adapter == 1 == cache.counters.evictions
        entry = cache.acquire(loras[2])
        assert entry is not None and entry.ticket.wait(10)
        assert memory.adapter_blocks.num_blocks() == 2 * need
        # Both held: no room can be made, and nothing is evicted trying.
        assert cache.acquire(loras[1]) is not None
        assert not memory.make_adapter_room(loras[0], frozenset())
        assert cache.counters.evictions == 1
        for lora in loras[1:]:
            cache.release(lora.id)
            cache.forget(lora.id)
        assert kv.num_free_blocks == kv.num_blocks and not memory.adapter_blocks.blocks
    finally:
        cache.loader.close()


def test_adapters_wanted_by_queued_requests_leave_last_in_the_pool_layout():
    memory, _ = pool_of(2, "lru")
    cache = memory.adapter_cache
    try:
        loras = [adapter(n, 8, seed=i) for i, n in enumerate(("old", "new", "third"))]
        for lora in loras[:2]:
            assert memory.make_adapter_room(lora, frozenset())
            assert cache.acquire(lora).ticket.wait(10)
            cache.release(lora.id)
        # A prefetch spares what queued requests want: with both wanted, nothing may leave.
        keep = frozenset({loras[0].id, loras[1].id})
        assert not memory.make_adapter_room(loras[2], keep, prefetch=True)
        assert not cache.prefetch(loras[2]) and cache.counters.evictions == 0
        # A request's load takes them too, the wanted ones last.
        assert memory.make_adapter_room(loras[2], frozenset({loras[0].id}))
        assert cache.holds(loras[0].id) and not cache.holds(loras[1].id)
    finally:
        cache.loader.close()


def test_in_the_static_layout_the_owner_evicts_within_the_adapter_budget():
    """The adapter cache's own byte budget, full of idle adapters: the cache alone refuses the
    load; the owner evicts the least recently used one (the cache counts it, the pool's
    counter stays at 0: no pool blocks are charged to adapters); no byte is left charged."""
    probe = build(EngineConfig(memory_layout="static", adapter_cache_bytes=1 << 24))
    one = probe.adapter_cache.charge(adapter("x", 8))
    probe.adapter_cache.loader.close()
    memory = build(EngineConfig(memory_layout="static", adapter_cache_bytes=2 * one,
                                eviction="lru", prefix_cache=False, link_gbps=0.0))  # fmt: skip
    cache = memory.adapter_cache
    try:
        loras = [adapter(n, 8, seed=i) for i, n in enumerate(("old", "new", "third"))]
        for lora in loras[:2]:
            assert memory.make_adapter_room(lora, frozenset())
            assert cache.acquire(lora).ticket.wait(10)
            cache.release(lora.id)
        assert cache.acquire(loras[2]) is None and cache.counters.evictions == 0
        assert [c.name for c in memory.reclaimer.adapter_order()] == ["old", "new"]
        assert memory.make_adapter_room(loras[2], frozenset())
        assert [cache.entries[i].resident.name for i in cache.entries] == ["new"]
        assert cache.counters.evictions == 1 and memory.counters.evictions_adapter == 0
        assert cache.acquire(loras[2]).ticket.wait(10) and cache.used_bytes == 2 * one
        cache.release(loras[2].id)
        for lora in loras[1:]:
            cache.forget(lora.id)
        assert cache.used_bytes == 0 and not cache.pool.resident
    finally:
        cache.loader.close()
