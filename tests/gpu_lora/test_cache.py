"""Device adapter cache: byte budget, reference counts, pipelined loads, and eviction through
the node's one owner (the reclaimer): it makes room, then the cache only allocates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import adapter_id as key
from tests.helpers import tiny_model_config
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.eviction import (
    Candidate,
    ChameleonPolicy,
    Eviction,
    LRUPolicy,
    Usage,
    make_policy,
)
from toppings.gpu_lora.loader import PipelinedLoader
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.server.memory.counters import MemoryCounters
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.reclaim import Reclaimer

CONFIG = tiny_model_config(
    name="t", vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
    head_dim=8, max_position_embeddings=64, tie_word_embeddings=True, eos_token_ids=(1,),
)  # fmt: skip


def adapter(name: str, rank: int, seed: int = 0, targets=("q_proj", "v_proj")) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(CONFIG.num_layers):
        for module in targets:
            h_in, h_out = CONFIG.projection_shape(module)
            weights[(layer, module)] = (
                torch.randn(rank, h_in, generator=gen),
                torch.randn(h_out, rank, generator=gen),
            )
    num_bytes = sum((a.numel() + b.numel()) * 4 for a, b in weights.values())
    return LoraAdapter(name, "/nowhere", rank, 2.0 * rank, 2.0, tuple(targets), weights,
                       num_bytes, None, id=key(name))  # fmt: skip


def make_cache(budget_bytes=None, link_gbps=0.0, memory=None, keep_idle=True):
    pool = AdapterPool(CONFIG, torch.float32, "cpu", initial_rows=8)
    loader = PipelinedLoader(pool, layers_per_group=1, link_gbps=link_gbps)
    cache = AdapterCache(pool, loader, budget_bytes, memory=memory, keep_idle=keep_idle)
    return cache, loader


def make_owner(cache: AdapterCache, policy: str = "lru") -> Reclaimer:
    """The node's owner of eviction over `cache` as the static layout builds it: adapters take
    no blocks of the (small, unused) KV pool, and there is no prefix cache."""
    kv = KVPool(CONFIG.num_layers, 16, CONFIG.num_kv_heads, CONFIG.head_dim, 1, 16, torch.float32)
    return Reclaimer(kv, None, None, cache, None, MemoryCounters(), Eviction.named(policy))


def take(owner: Reclaimer, lora: LoraAdapter, keep: frozenset[int] = frozenset()):
    """Admission's order: the owner makes room for the load, then the cache only allocates."""
    owner.make_adapter_room(lora, keep)
    return owner.cache.acquire(lora)


class FakeMemory:
    """An `AdapterBudget` of a fixed number of bytes that records what it is asked."""

    def __init__(self, num_bytes: int):
        self.free = num_bytes
        self.charged: dict[int, int] = {}
        self.asked: list[tuple[int, bool]] = []

    def take(self, adapter_id: int, num_bytes: int, promised: bool) -> bool:
        self.asked.append((adapter_id, promised))
        if num_bytes > self.free:
            return False
        self.free -= num_bytes
        self.charged[adapter_id] = num_bytes
        return True

    def give(self, adapter_id: int) -> None:
        self.free += self.charged.pop(adapter_id)

    def capacity_bytes(self) -> int:
        # The whole memory, KV included: more than adapters can be charged at the moment.
        return 4 * (self.free + sum(self.charged.values()))


def test_load_copies_every_layer_into_the_pool_rows():
    cache, loader = make_cache()
    a = adapter("a", 4, seed=1)
    entry = cache.acquire(a)
    assert entry.ticket.wait(10)
    rows = slice(entry.resident.offset, entry.resident.offset + 4)
    for (layer, module), (wa, wb) in a.weights.items():
        assert torch.equal(cache.pool.lora_a[module][layer, rows], wa)
        assert torch.equal(cache.pool.lora_b[module][layer, rows], wb.t())
    assert cache.counters.loads == 1 and cache.counters.bytes_loaded == a.num_bytes
    loader.close()


def test_the_cache_alone_never_evicts():
    one = adapter("x", 4).num_bytes
    cache, loader = make_cache(budget_bytes=2 * one)
    for name in ("a", "b"):
        cache.acquire(adapter(name, 4)).ticket.wait(10)
        cache.release(key(name))
    assert not cache.has_room(adapter("c", 4))
    assert cache.acquire(adapter("c", 4)) is None  # allocation only allocates
    assert set(cache.entries) == {key("a"), key("b")} and cache.counters.evictions == 0
    owner = make_owner(cache)
    assert owner.make_adapter_room(adapter("c", 4), frozenset())
    assert cache.counters.evictions == 1 and cache.acquire(adapter("c", 4)) is not None
    loader.close()


def test_budget_evicts_unreferenced_adapters_and_never_referenced_ones():
    one = adapter("x", 4).num_bytes
    cache, loader = make_cache(budget_bytes=2 * one)
    owner = make_owner(cache)
    ea = take(owner, adapter("a", 4))
    take(owner, adapter("b", 4))
    # Full, both referenced: no room can be made.
    assert not owner.make_adapter_room(adapter("c", 4), frozenset())
    assert take(owner, adapter("c", 4)) is None
    cache.release(key("b"))
    ec = take(owner, adapter("c", 4))
    assert ec is not None and key("b") not in cache.entries and key("a") in cache.entries
    assert cache.used_bytes <= 2 * one
    assert cache.counters.evictions == 1
    ea.ticket.wait(10)
    ec.ticket.wait(10)
    assert torch.equal(
        cache.pool.lora_a["q_proj"][0, ec.resident.offset],
        adapter("c", 4).weights[(0, "q_proj")][0][0],
    )
    loader.close()


def test_adapters_of_queued_requests_are_evicted_last():
    one = adapter("x", 4).num_bytes
    cache, loader = make_cache(budget_bytes=2 * one)
    owner = make_owner(cache)
    for name in ("old", "new"):
        take(owner, adapter(name, 4))
        cache.release(key(name))
    take(owner, adapter("c", 4), keep=frozenset({key("old")}))
    assert set(cache.entries) == {key("old"), key("c")}
    loader.close()


def test_hits_share_one_load_and_release_is_checked():
    cache, loader = make_cache()
    a = adapter("a", 8)
    e1, e2 = cache.acquire(a), cache.acquire(a)
    assert e1 is e2 and e1.refcount == 2
    assert (cache.counters.hits, cache.counters.misses) == (1, 1)
    cache.release(key("a"))
    cache.release(key("a"))
    with pytest.raises(RuntimeError):
        cache.release(key("a"))
    with pytest.raises(ValueError):
        make_cache(budget_bytes=10)[0].acquire(a)
    loader.close()


def test_throttled_load_reports_layers_in_order():
    a = adapter("a", 8)
    # About 0.3 s for the whole adapter: the ticket must show partial progress on the way.
    cache, loader = make_cache(link_gbps=a.num_bytes * 8 / 0.3 / 1e9)
    ticket = cache.acquire(a).ticket
    seen = []
    while not ticket.done:
        seen.append(ticket.layers_ready())
    assert seen == sorted(seen) and seen[0] < CONFIG.num_layers
    assert ticket.layers_ready() == CONFIG.num_layers
    loader.close()


def test_lru_and_chameleon_orders():
    stats = [
        Candidate.adapter("small_hot", "small_hot", 100, Usage(last_used=5.0, frequency=50)),
        Candidate.adapter("big_cold", "big_cold", 1000, Usage(last_used=1.0, frequency=1)),
        Candidate.adapter("small_cold", "small_cold", 100, Usage(last_used=2.0, frequency=2)),
    ]
    assert [s.name for s in LRUPolicy().order(stats)] == ["big_cold", "small_cold", "small_hot"]
    # Chameleon keeps the big adapter (costly to reload): the small cold one goes first.
    assert ChameleonPolicy().order(stats)[0].name == "small_cold"
    with pytest.raises(ValueError):
        make_policy("fifo")


def test_a_shared_memory_is_charged_each_load_and_given_back_on_eviction():
    one = adapter("x", 4).num_bytes
    memory = FakeMemory(2 * one)
    cache, loader = make_cache(memory=memory)
    for name in ("a", "b"):
        cache.acquire(adapter(name, 4)).ticket.wait(10)
    assert cache.acquire(adapter("c", 4)) is None  # the memory refused: nothing was loaded
    asked = [(key("a"), True), (key("b"), True), (key("c"), True)]  # (id, promised)
    assert memory.asked == asked and not cache.holds(key("c"))
    cache.release(key("b"))
    assert cache.is_pinned(key("a")) and not cache.is_pinned(key("b"))  # both loads have landed
    assert cache.referenced() == [key("a")] and cache.num_entries == 2
    (idle,) = cache.idle_candidates()
    assert (idle.name, idle.num_bytes, idle.visits, idle.rank) == ("b", one, 1, 4)
    cache.evict(key("b"))
    assert memory.free == one and key("b") not in memory.charged
    assert cache.prefetch(adapter("c", 4))  # a prefetch takes no promised room
    assert memory.asked[-1] == (key("c"), False)
    assert cache.frequencies() == {key("a"): 1, key("b"): 1, key("c"): 0}
    loader.close()


def test_an_adapter_loaded_again_under_its_name_never_gets_the_old_ones_rows():
    """The cache keys adapters by id: A registered as "x" stays cached (idle) when B is
    registered as "x" (another id); B misses and gets its own rows, and A's stay A's."""
    cache, loader = make_cache()
    old = adapter("x", 4, seed=1)
    cache.acquire(old).ticket.wait(10)
    cache.release(old.id)
    new = dataclasses.replace(adapter("x", 4, seed=2), id=key("x, registered again"))
    entry = cache.acquire(new)
    assert entry.ticket.wait(10)
    assert (cache.counters.hits, cache.counters.misses) == (0, 2)
    assert entry is not cache.entries[old.id] and entry.resident.id == new.id
    rows = slice(entry.resident.offset, entry.resident.offset + 4)
    for (layer, module), (wa, wb) in new.weights.items():
        assert torch.equal(cache.pool.lora_a[module][layer, rows], wa)
        assert torch.equal(cache.pool.lora_b[module][layer, rows], wb.t())
    cache.release(new.id)
    cache.forget(old.id)
    assert list(cache.entries) == [new.id] and cache.frequencies() == {new.id: 1}
    loader.close()
