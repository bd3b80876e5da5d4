"""The default LoRA mode serves more adapters than the device's adapter memory holds (issue 64):
the engine starts with every one registered and pages them through the cache, each request
getting its adapter's tokens, where `cached` refuses the registration that does not fit."""

from __future__ import annotations

import pytest

from toppings.server.config import EngineConfig
from toppings.server.lora_modes import LORA_MODES
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams

NUM_ADAPTERS = 6


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_model_dir):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("paging")
    return {f"a{i}": str(make_random_adapter(root / f"a{i}", tiny_model_dir, rank=8, seed=i))
            for i in range(NUM_ADAPTERS)}  # fmt: skip


def _tokens(engine, name: str) -> list[int]:
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    handle = engine.submit(GenerationRequest([1, 2, 3, 4], params, engine.resolve_adapter(name)))
    return handle.result(60).new_token_ids


def test_the_default_pages_adapters_past_the_device_room(tiny_engine, adapter_dirs):
    default = EngineConfig()
    assert not any(LORA_MODES[default.mode_on(d)].preload for d in ("cpu", "cuda"))  # it pages
    with tiny_engine({"a0": adapter_dirs["a0"]}, max_total_tokens=1024) as probe:
        _tokens(probe, "a0")
        one = probe.lora.cache.used_bytes  # what one adapter occupies on the device
    room = 2 * one  # two of the six at a time
    want = {}
    with tiny_engine(adapter_dirs, max_total_tokens=1024, lora_mode="cached") as roomy:
        for name in adapter_dirs:
            want[name] = _tokens(roomy, name)
    paging = dict(max_total_tokens=1024, adapter_cache_bytes=room, lora_mode="auto")
    with tiny_engine(adapter_dirs, **paging) as engine:
        assert len(engine.adapters()) == NUM_ADAPTERS
        for _ in range(2):  # every adapter evicted and loaded again on the second pass
            for name in adapter_dirs:
                assert _tokens(engine, name) == want[name], name
                assert engine.lora.cache.used_bytes <= room
        assert engine.lora.cache.counters.evictions >= NUM_ADAPTERS
    with pytest.raises(RequestError, match="the adapter cache is full"):
        with tiny_engine(adapter_dirs, max_total_tokens=1024, adapter_cache_bytes=room,
                         lora_mode="cached"):  # fmt: skip
            pass
