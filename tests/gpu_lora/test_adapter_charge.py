"""What an adapter occupies in the device pool is what it is charged, before anything is
allocated, and the pool's tensors never outgrow the cache's budget (issue 33: an adapter on one
projection of one layer used to grow rows in every layer of every projection)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu_lora.peft_dirs import write_peft_adapter
from tests.helpers import adapter_id as key
from tests.helpers import tiny_model_config
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.eviction import Eviction
from toppings.gpu_lora.loader import PipelinedLoader
from toppings.gpu_lora.peft.adapter import (
    AdapterError,
    LoraAdapter,
    inspect_peft_adapter,
    load_peft_adapter,
)
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.server.memory.counters import MemoryCounters
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.reclaim import Reclaimer

CONFIG = tiny_model_config()  # L 3, H 128, I 256
ITEM = 4  # float32


def adapter(name: str, rank: int, pairs: list[tuple[int, str]], seed: int = 0) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer, module in pairs:
        h_in, h_out = CONFIG.projection_shape(module)
        weights[(layer, module)] = (
            torch.randn(rank, h_in, generator=gen),
            torch.randn(h_out, rank, generator=gen),
        )
    modules = tuple(m for m in LORA_TARGETS if any(m == p[1] for p in pairs))
    num_bytes = sum((a.numel() + b.numel()) * ITEM for a, b in weights.values())
    return LoraAdapter(name, "/nowhere", rank, 2.0 * rank, 2.0, modules, weights, num_bytes, None,
                       id=key(name))  # fmt: skip


def rows_bytes(rank: int, modules) -> int:
    """rank rows in every layer of each projection (A and B^T, float32)."""
    return sum(rank * CONFIG.num_layers * sum(CONFIG.projection_shape(m)) * ITEM for m in modules)


def make_cache(budget_bytes=None):
    pool = AdapterPool(CONFIG, torch.float32, "cpu")
    loader = PipelinedLoader(pool)
    return AdapterCache(pool, loader, budget_bytes), loader


def make_owner(cache: AdapterCache) -> Reclaimer:
    """The node's owner of eviction over `cache` (the static layout's: no KV candidates)."""
    kv = KVPool(CONFIG.num_layers, 16, CONFIG.num_kv_heads, CONFIG.head_dim, 1, 16, torch.float32)
    return Reclaimer(kv, None, None, cache, None, MemoryCounters(), Eviction.named("lru"))


def take(owner: Reclaimer, lora: LoraAdapter):
    """Admission's order: the owner makes room, then the cache only allocates."""
    owner.make_adapter_room(lora, frozenset())
    return owner.cache.acquire(lora)


def test_one_projection_of_one_layer_takes_rows_of_that_projection_only():
    cache, loader = make_cache(budget_bytes=rows_bytes(64, ["q_proj"]))
    one = adapter("one", 64, [(1, "q_proj")])
    entry = cache.acquire(one)
    assert entry is not None and entry.ticket.wait(10)
    charge = rows_bytes(64, ["q_proj"])
    assert cache.used_bytes == charge == cache.pool.bytes_for(64, ["q_proj"])
    assert cache.pool.nbytes == charge  # measured on the tensors themselves
    assert set(cache.pool.lora_a) == {"q_proj"}
    a, b = one.weights[(1, "q_proj")]
    rows = slice(entry.resident.offset, entry.resident.offset + 64)
    assert torch.equal(cache.pool.lora_a["q_proj"][1, rows], a)
    assert torch.equal(cache.pool.lora_b["q_proj"][1, rows], b.t())
    assert not cache.pool.lora_a["q_proj"][0].any() and not cache.pool.lora_a["q_proj"][2].any()
    loader.close()


def test_pool_stays_within_the_budget_through_loads_and_evictions():
    budget = rows_bytes(48, ["q_proj", "v_proj"])
    cache, loader = make_cache(budget_bytes=budget)
    owner = make_owner(cache)
    rng = random.Random(5)
    for i in range(40):
        rank = rng.choice((1, 4, 8, 16, 32))
        modules = rng.sample(LORA_TARGETS, rng.choice((1, 2, 3)))
        if rows_bytes(rank, modules) > budget:
            continue
        pairs = [(rng.randrange(CONFIG.num_layers), m) for m in modules]
        entry = take(owner, adapter(f"a{i}", rank, pairs, seed=i))
        assert entry is not None
        entry.ticket.wait(10)
        cache.release(key(f"a{i}"))
        assert cache.used_bytes <= budget
        assert cache.pool.nbytes <= budget, (i, cache.pool.nbytes, budget)
    loader.close()


class FixedMemory:
    """An `AdapterBudget` of a fixed number of bytes (the node's memory pool, without KV)."""

    def __init__(self, num_bytes: int):
        self.num_bytes = num_bytes
        self.charged: dict[str, int] = {}

    def take(self, name: str, num_bytes: int, promised: bool) -> bool:
        if sum(self.charged.values()) + num_bytes > self.num_bytes:
            return False
        self.charged[name] = num_bytes
        return True

    def give(self, name: str) -> None:
        del self.charged[name]

    def capacity_bytes(self) -> int:
        return self.num_bytes


def test_pool_stays_within_the_memory_it_is_charged_to():
    """No cache budget, adapters charged to the node's memory: the pool's tensors stay within
    that memory, and the charges always find room once the rows did."""
    memory = FixedMemory(rows_bytes(40, ["q_proj", "up_proj"]))
    pool = AdapterPool(CONFIG, torch.float32, "cpu")
    loader = PipelinedLoader(pool)
    cache = AdapterCache(pool, loader, None, memory=memory)
    owner = make_owner(cache)
    rng = random.Random(7)
    for i in range(40):
        rank = rng.choice((2, 8, 16, 32))
        modules = rng.sample(LORA_TARGETS, rng.choice((1, 2)))
        if rows_bytes(rank, modules) > memory.num_bytes:
            continue
        entry = take(owner, adapter(f"a{i}", rank, [(0, m) for m in modules], seed=i))
        assert entry is not None
        entry.ticket.wait(10)
        cache.release(key(f"a{i}"))
        assert pool.nbytes <= memory.num_bytes, (i, pool.nbytes)
        assert sum(memory.charged.values()) == cache.used_bytes <= pool.nbytes
    loader.close()


def test_adapters_with_disjoint_targets_share_rows_and_are_exact():
    cache, loader = make_cache()
    q = adapter("q", 8, [(layer, "q_proj") for layer in range(CONFIG.num_layers)], seed=1)
    k = adapter("k", 8, [(layer, "k_proj") for layer in range(CONFIG.num_layers)], seed=2)
    eq = cache.acquire(q)
    assert eq.ticket.wait(10)  # k's tensors are made next: never under a running load
    ek = cache.acquire(k)
    assert ek.ticket.wait(10)
    assert eq.resident.offset == ek.resident.offset == 0
    for ad, entry in ((q, eq), (k, ek)):
        rows = slice(entry.resident.offset, entry.resident.offset + 8)
        for (layer, module), (a, _) in ad.weights.items():
            assert torch.equal(cache.pool.lora_a[module][layer, rows], a)
    cache.release(key("q"))
    cache.evict(key("q"))
    assert not cache.pool.lora_a["q_proj"].any()  # freed rows are zero for the next adapter
    assert torch.equal(cache.pool.lora_a["k_proj"][0, :8], k.weights[(0, "k_proj")][0])
    loader.close()


def test_adapter_larger_than_the_budget_is_refused_before_any_allocation():
    cache, loader = make_cache(budget_bytes=rows_bytes(8, ["q_proj"]))
    with pytest.raises(ValueError, match="bytes"):
        cache.acquire(adapter("big", 16, [(0, "q_proj")]))
    assert cache.pool.nbytes == 0 and not cache.pool.lora_a
    loader.close()


def test_inspect_reads_rank_and_targets_from_config_and_header(tmp_path):
    path = write_peft_adapter(tmp_path / "ad", CONFIG, rank=12, modules=("v_proj",), layers=(2,))
    shape = inspect_peft_adapter(path, CONFIG)
    assert (shape.rank, shape.max_rank, shape.modules) == (12, 12, ("v_proj",))
    assert shape.targeted == frozenset({(2, "v_proj")})
    assert len(load_peft_adapter(path, CONFIG).weights) == 1


def test_inspect_sees_a_header_rank_above_the_config(tmp_path):
    path = write_peft_adapter(tmp_path / "ad", CONFIG, rank=4000, layers=(0,))
    cfg = path / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"r": 4000', '"r": 4'))
    assert inspect_peft_adapter(path, CONFIG).max_rank == 4000
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(AdapterError, match="safetensors"):
        inspect_peft_adapter(path, CONFIG)


def test_a_large_adapter_finds_rows_where_the_budget_has_room_for_it():
    # Two rank-128 adapters exactly fill the budget. Placed first-fit after a small one, the
    # first would sit at rows 8-136 and leave no 128 contiguous rows once the small one is
    # evicted: the second would wait for the first to end though the budget holds both (a
    # 2.2 s wait at light load in bench_queueing). Aligned to its size it leaves them.
    layers = [(layer, "q_proj") for layer in range(CONFIG.num_layers)]
    cache, loader = make_cache(budget_bytes=rows_bytes(256, ["q_proj"]))
    owner = make_owner(cache)
    small = take(owner, adapter("small", 8, layers))
    small.ticket.wait(10)
    cache.release(key("small"))
    first = take(owner, adapter("first", 128, layers, seed=1))
    assert first is not None and first.resident.offset % 128 == 0
    first.ticket.wait(10)
    second = take(owner, adapter("second", 128, layers, seed=2))
    assert second is not None, "the budget holds both: the small idle one is evicted"
    second.ticket.wait(10)
    assert key("small") not in cache.entries and cache.pool.nbytes <= rows_bytes(256, ["q_proj"])
    assert {first.resident.offset, second.resident.offset} == {0, 128}
    loader.close()


def assert_rows_hold(pool: AdapterPool, lora: LoraAdapter) -> None:
    """The adapter's A and B^T sit at its pool rows in every layer it covers."""
    entry = pool.resident[lora.id]
    rows = slice(entry.offset, entry.offset + lora.rank)
    for (layer, module), (a, b) in lora.weights.items():
        assert torch.equal(pool.lora_a[module][layer, rows], a)
        assert torch.equal(pool.lora_b[module][layer, rows], b.t())


def test_adapters_in_use_are_packed_to_make_room_for_a_load():
    # x, y, z (rank 64, held by requests) take rows 0-191 of a 256-row budget; y ends and is
    # evicted: 128 rows are free in bytes, but as 64-127 and 192-255. Without packing the
    # rank-128 request waits for x or z to end (1.5 s at the head of a burst's FCFS queue).
    layers = [(layer, "q_proj") for layer in range(CONFIG.num_layers)]
    cache, loader = make_cache(budget_bytes=rows_bytes(256, ["q_proj"]))
    owner = make_owner(cache)
    adapters = {n: adapter(n, 64, layers, seed=i) for i, n in enumerate("xyz")}
    for name in "xyz":
        take(owner, adapters[name]).ticket.wait(10)
    assert [cache.entries[key(n)].resident.offset for n in "xyz"] == [0, 64, 128]
    cache.release(key("y"))
    big = adapter("big", 128, layers, seed=9)
    entry = take(owner, big)
    assert entry is not None, "the budget holds x, z and big once z's rows move down"
    entry.ticket.wait(10)
    assert key("y") not in cache.entries and cache.counters.compactions == 1
    assert cache.entries[key("z")].resident.offset == 64 and entry.resident.offset == 128
    # what the next step reads:
    assert cache.entries[key("z")].resident is cache.pool.resident[key("z")]
    for lora in (adapters["x"], adapters["z"], big):
        assert_rows_hold(cache.pool, lora)
    assert cache.pool.nbytes <= rows_bytes(256, ["q_proj"])
    loader.close()


def test_packing_keeps_adapters_being_loaded_in_place():
    pool = AdapterPool(CONFIG, torch.float32, "cpu")
    pairs = [(layer, m) for layer in range(CONFIG.num_layers) for m in ("q_proj", "v_proj")]
    adapters = [adapter(f"a{i}", r, pairs, seed=i) for i, r in enumerate((16, 8, 16, 32, 8))]
    for lora in adapters:
        pool.add(lora)
    # offsets a0 0, a1 16, a4 24 (aligned to 8), a2 32, a3 64; a4's load is writing its rows
    assert [pool.resident[key(f"a{i}")].offset for i in (0, 1, 4, 2, 3)] == [0, 16, 24, 32, 64]
    pool.remove(key("a0"))
    pool.remove(key("a1"))  # rows 0-23 free
    moved = pool.compact(fixed=frozenset({key("a4")}))
    assert {e.name: e.offset for e in moved.values()} == {"a2": 0, "a3": 32}
    assert pool.resident[key("a4")].offset == 24
    for lora in adapters[2:]:
        assert_rows_hold(pool, lora)
    for module in ("q_proj", "v_proj"):
        assert not pool.lora_a[module][:, 64:].any() and not pool.lora_b[module][:, 64:].any()


def test_the_pool_generation_moves_with_every_change_a_lora_batch_reads():
    """A decode step's LoRA batch is run again while the pool's generation stays
    (server/adapters/step.py): every change of where an adapter sits moves it, a compaction
    that moves nothing does not."""
    pool = AdapterPool(CONFIG, torch.float32, "cpu", initial_rows=8)
    pairs = [(0, "q_proj"), (1, "v_proj")]
    a, b, c = (adapter(n, r, pairs, seed=i) for i, (n, r) in enumerate((("a", 8), ("b", 8),
                                                                       ("c", 8))))  # fmt: skip
    seen = [pool.generation]

    def moved() -> bool:
        seen.append(pool.generation)
        return seen[-1] != seen[-2]

    pool.reserve(a)
    assert moved()
    tables = dict(pool.lora_a)
    pool.reserve(b)  # past the 8 initial rows: the tables grow
    assert moved() and pool.lora_a["q_proj"] is not tables["q_proj"]
    pool.reserve(c)
    assert moved()
    assert not pool.compact() and not moved()  # packed already
    pool.remove(key("a"))
    assert moved()
    assert pool.compact() and moved()  # b and c slide down
    pool.rename(key("b"), "b2")
    assert moved()
