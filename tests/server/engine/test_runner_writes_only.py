"""The model runner only writes the KV slots the scheduler reserved (issue 45): nothing
allocates, evicts, swaps or waits on an adapter load while `ModelRunner.run` executes. The
pool is small, so that cached prefixes must leave it for new requests: the scheduler makes
that room before the step (`MemoryManager.allocate`)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_memory_balanced
from tests.server.engine.test_exactness import make_adapters
from toppings.server.requests.request import GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def forbid_during_run(engine, monkeypatch) -> list[str]:
    """Make every allocator, evictor and load wait of the engine raise (and be recorded) while
    the runner runs a plan; returns the list of what was called."""
    called: list[str] = []
    in_run = [False]
    run = engine.runner.run

    def guarded_run(plan):
        in_run[0] = True
        try:
            return run(plan)
        finally:
            in_run[0] = False

    def guard(owner, name):
        real = getattr(owner, name, None)
        if real is None:
            return

        def guarded(*args, **kwargs):
            if in_run[0]:
                called.append(name)
                raise AssertionError(f"{name} called during the forward")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, guarded)

    kv, memory = engine.kv, engine.memory
    for name in ("alloc_blocks", "extend", "extend_each", "reserve", "free_blocks"):
        guard(kv, name)
    guard(memory.reclaimer, "reclaim")
    guard(memory.adapter_cache, "evict")
    guard(memory.adapter_cache, "acquire")
    guard(engine.lora.steps, "wait_for_loads")
    if memory.swap is not None:
        guard(memory.swap, "swap_in")
        guard(memory.swap, "swap_out")
    monkeypatch.setattr(engine.runner, "run", guarded_run)
    return called


@pytest.mark.parametrize("chunked", [True, False])
def test_the_runner_never_allocates_evicts_or_waits(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, chunked
):
    adapters = make_adapters(tmp_path, tiny_model_dir)
    budget = {"max_num_batched_tokens": 24, "max_batch_size": 8} if chunked else {}
    with tiny_engine(adapters, chunked_prefill=chunked, max_total_tokens=256, block_tokens=16,
                     lora_mode="on-demand-sync", **budget) as engine:  # fmt: skip
        called = forbid_during_run(engine, monkeypatch)
        names = [None, *sorted(adapters)]
        # rounds of prompts sharing 32-token prefixes per adapter: prefix reuse, and cached
        # prefixes that the 16-block pool must evict to admit the next round
        for round_ in range(3):
            handles = []
            for i, name in enumerate(names):
                prompt = [7 + i] * 32 + [11 + round_ + j for j in range(9 + 5 * i)]
                request = GenerationRequest(prompt, GREEDY, engine.resolve_adapter(name))
                handles.append(engine.submit(request))
            outs = [h.result(timeout_s=120) for h in handles]
            assert [o.finish_reason for o in outs] == ["length"] * len(names), outs
        assert called == []
        counters = engine.memory.view()
        assert counters["prefix_hit_tokens"] > 0  # prefixes were reused
        assert counters["evictions_kv"] > 0  # and evicted to make room, before steps
        assert_memory_balanced(engine)
