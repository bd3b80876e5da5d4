"""An adapter load that fails (a copy raising in the loader thread) fails the requests waiting
for that adapter with an error, leaves nothing pinned, and the next request loads it again."""

from __future__ import annotations

from tests.helpers import assert_memory_balanced
from tests.server.engine.test_exactness import make_adapters
from toppings.server.requests.request import GenerationRequest, SamplingParams

PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def test_a_failed_load_fails_its_request_alone_and_the_adapter_loads_again(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch
):
    adapters = make_adapters(tmp_path, tiny_model_dir)
    name = sorted(adapters)[0]
    with tiny_engine(adapters, lora_mode="on-demand", memory_bytes=1 << 22) as engine:
        loader = engine.lora.loader
        load = loader._load
        failures = []

        def fail_once(adapter, entry, ticket):
            if not failures:
                failures.append(adapter.name)
                raise OSError("copy failed")
            load(adapter, entry, ticket)

        monkeypatch.setattr(loader, "_load", fail_once)
        bad = engine.submit(
            GenerationRequest([5, 9, 17], PARAMS, engine.resolve_adapter(name))
        ).result(timeout_s=60)
        assert bad.error is not None and "copy failed" in bad.error
        base = engine.submit(GenerationRequest([5, 9, 17], PARAMS, None)).result(timeout_s=60)
        assert base.error is None and len(base.new_token_ids) == 4
        good = engine.submit(
            GenerationRequest([5, 9, 17], PARAMS, engine.resolve_adapter(name))
        ).result(timeout_s=60)
        assert good.error is None and len(good.new_token_ids) == 4
        assert failures == [name] and engine.lora.cache.counters.loads == 2
        assert_memory_balanced(engine)
