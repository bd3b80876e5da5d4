"""The typed counter views (server.requests.engine_counters) name what their owners report.

A view drops the keys it does not know and leaves a missing one at its default, so a field
misspelt in a view would read None (or 0) forever without failing; here every field is checked
against the dict its owner really writes, on an engine whose owners report everything (the
pool layout with an adapter byte budget, the chameleon queue policy)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from toppings.server.engine.reports import queue_view
from toppings.server.requests.engine_counters import (
    AdapterCacheView,
    BlockCounts,
    MemoryView,
    QueueView,
)
from toppings.server.requests.request import GenerationRequest, SamplingParams

KV_EVENTS = {"kv_events_batches", "kv_events_dropped", "kv_events_resyncs_asked"}


def names(view: type) -> set[str]:
    return {f.name for f in fields(view)}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("counter_views")
    return {"r8": str(make_random_adapter(root / "r8", tiny_model_dir, rank=8, seed=8))}


def test_every_view_field_is_a_key_its_owner_reports(tiny_engine, adapters):
    with tiny_engine(
        adapters, queue_policy="chameleon", memory_layout="pool", adapter_cache_bytes=4 << 20
    ) as engine:
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        request = GenerationRequest([5, 6, 7], params, engine.resolve_adapter("r8"))
        engine.submit(request).result(timeout_s=300)
        snapshot = engine.lora.cache.snapshot()
        memory = engine.memory.view()
        queueing = queue_view(engine.scheduler)
        counters = engine.counters()
    assert names(AdapterCacheView) <= set(snapshot)
    assert names(MemoryView) - KV_EVENTS <= set(memory)  # KV events are off here
    assert names(BlockCounts) == set(memory["blocks"])
    assert names(QueueView) <= set(queueing)
    assert counters.adapter_cache.misses == snapshot["misses"] >= 1
    assert counters.adapter_cache.resident == tuple(snapshot["resident"]) == ("r8",)
    assert counters.memory.blocks.total == memory["blocks"]["total"] > 0
    assert counters.queueing.quotas == tuple(queueing["quotas"])
    assert counters.memory.kv_events_batches is None


def test_a_view_keeps_known_keys_and_defaults_missing_ones():
    view = MemoryView.from_view({"swaps_in": 3, "layout": "static", "blocks": {"free": 2}})
    assert view.swaps_in == 3 and view.block_tokens is None
    assert view.blocks == BlockCounts(free=2)
    fcfs = QueueView.from_view({"policy": "fcfs", "queue_lengths": [4]})
    assert fcfs.queue_lengths == (4,) and fcfs.quotas is None and fcfs.bypasses is None
