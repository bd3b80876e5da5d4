"""The adapter cache without a cache (`--adapter-cache off`): an adapter leaves the device when
its last request ends, a loading one once it has landed, and nothing is prefetched."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_lora.test_cache import CONFIG, adapter, make_cache, make_owner, take
from tests.helpers import adapter_id as key
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.loader import LoadTicket
from toppings.server.config import EngineConfig


def test_an_adapter_leaves_when_its_last_reference_ends():
    cache, loader = make_cache(keep_idle=False)
    a = adapter("a", 4)
    cache.acquire(a).ticket.wait(10)
    cache.acquire(a)
    cache.release(key("a"))
    assert cache.holds(key("a"))  # one request still holds it
    cache.release(key("a"))
    assert not cache.holds(key("a")) and cache.used_bytes == 0
    assert cache.acquire(a) is not None and cache.counters.loads == 2  # loaded again
    loader.close()


def test_with_keep_idle_the_same_adapter_stays():
    cache, loader = make_cache()
    a = adapter("a", 4)
    cache.acquire(a).ticket.wait(10)
    cache.release(key("a"))
    cache.acquire(a)
    assert cache.counters.loads == 1 and cache.counters.hits == 1
    loader.close()


class HeldLoader:
    """A loader whose copies land only when the test says so (`land`)."""

    def __init__(self):
        self.tickets: list[LoadTicket] = []

    def submit(self, adapter, entry) -> LoadTicket:
        self.tickets.append(LoadTicket(CONFIG.num_layers))
        return self.tickets[-1]

    def idle(self) -> bool:
        return True

    def land(self) -> None:
        for ticket in self.tickets:
            ticket.mark_ready(CONFIG.num_layers)


def test_a_still_loading_adapter_leaves_at_the_next_acquire_after_it_landed():
    loader = HeldLoader()
    pool = AdapterPool(CONFIG, torch.float32, "cpu", initial_rows=8)
    cache = AdapterCache(pool, loader, keep_idle=False)
    owner = make_owner(cache)
    take(owner, adapter("a", 4))
    cache.release(key("a"))
    assert cache.holds(key("a"))  # its rows are being written: not taken from under the copy
    take(owner, adapter("b", 4, seed=1))
    assert cache.holds(key("a"))
    loader.land()
    take(owner, adapter("c", 4, seed=2))
    assert not cache.holds(key("a")) and cache.holds(key("b")) and cache.holds(key("c"))


def test_nothing_is_prefetched():
    cache, loader = make_cache(keep_idle=False)
    assert cache.prefetch(adapter("a", 4)) is False
    assert not cache.holds(key("a"))
    loader.close()


def test_the_flag_is_refused_where_every_adapter_is_preloaded():
    with pytest.raises(ValueError, match="adapter_cache off"):
        EngineConfig(lora_mode="cached", adapter_cache=False)
    assert not EngineConfig(lora_mode="on-demand", adapter_cache=False).adapter_cache
