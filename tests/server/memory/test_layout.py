"""The memory layouts' answers: KV slots, whether adapters are charged, admission's sizes."""

from __future__ import annotations

import pytest

from tests.helpers import tiny_model_config
from toppings.server.config import MemoryConfig
from toppings.server.memory.layout import LAYOUTS, MemoryLayout, make_layout

MODEL = tiny_model_config()


def slot_bytes(itemsize: int = 4) -> int:
    return 2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim * itemsize


def no_device():
    raise AssertionError("a CPU layout with a budget never asks the device")


def test_every_layout_has_a_class():
    assert set(LAYOUTS) == set(MemoryLayout)
    for kind, cls in LAYOUTS.items():
        assert cls.kind is kind


def layout_of(memory: MemoryConfig, device: str = "cpu", adapter_cache_bytes: int = 0):
    return make_layout(
        memory.memory_layout, memory, device=device, adapter_cache_bytes=adapter_cache_bytes
    )


def test_static_keeps_its_split():
    layout = layout_of(MemoryConfig(memory_layout="static", max_total_tokens=256), "cpu", 1000)
    assert layout.kind is MemoryLayout.STATIC
    assert layout.kv_slots(MODEL, 4, no_device) == 256
    assert not layout.charges_adapters() and layout.adapter_memory_is_scarce()
    assert layout.total_tokens(256, 10.0) == 256 + 100
    assert not layout_of(MemoryConfig(memory_layout="static")).adapter_memory_is_scarce()


def test_pool_budget_and_charging():
    layout = layout_of(MemoryConfig(memory_layout="pool", memory_bytes=100 * slot_bytes()))
    assert layout.kind is MemoryLayout.POOL
    assert layout.kv_slots(MODEL, 4, no_device) == 100
    assert layout.charges_adapters() and layout.adapter_memory_is_scarce()
    assert layout.total_tokens(100, 10.0) == 100
    # No budget on a CPU: max_total_tokens of KV plus the adapter bytes, adapters not charged.
    layout = layout_of(MemoryConfig(memory_layout="pool", max_total_tokens=64))
    assert layout.kv_slots(MODEL, 4, no_device) == 64 and not layout.charges_adapters()
    # On CUDA without a budget: a share of the free device memory.
    cuda = layout_of(MemoryConfig(memory_layout="pool"), "cuda")
    assert cuda.kv_slots(MODEL, 4, lambda: 1000 * slot_bytes()) == 400


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError):
        make_layout("split", MemoryConfig(), device="cpu", adapter_cache_bytes=0)
