"""KV prefix reuse per adapter and the one memory pool, on a tiny random Llama.

Exactness: greedy tokens with a reused prefix equal transformers + PEFT's (the rule of
test_exactness.py) for every kernel and LoRA mode, and a prefix cached under one adapter is
never used under another. Memory: KV pressure evicts idle adapters, idle KV leaves room for more
adapters than a static split of the same budget, the host tier swaps blocks out and back, and
after a soak with cancellations every block is free or cached.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import assert_memory_balanced
from tests.server.engine.test_exactness import (
    NEW_TOKENS,
    assert_same_greedy,
    make_adapters,
    reference_greedy,
)
from toppings.server.requests.request import GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return make_adapters(tmp_path_factory.mktemp("prefix_adapters"), tiny_model_dir)


def run(engine, prompt, adapter, params=GREEDY):
    return engine.submit(
        GenerationRequest(list(prompt), params, engine.resolve_adapter(adapter))
    ).result(timeout_s=300)


def memory(engine) -> dict:
    return engine.stats().to_json()["memory"]


@pytest.mark.parametrize(
    ("kernel", "lora_mode"),
    [("mbgmv", "cached"), ("bgmv", "cached"), ("mbgmv", "on-demand"), ("mbgmv", "cpu-assisted")],
)
def test_reused_prefix_gives_each_adapter_its_own_tokens(
    tiny_model_dir, tiny_engine, adapters, kernel, lora_mode
):
    """Two adapters and the base model send the same 40-token prefix, then a follow-up turn
    (prefix + its answer + more): the follow-ups reuse blocks cached under their own adapter
    only, and every output equals transformers + PEFT's."""
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 200, (40,), generator=gen).tolist()
    with tiny_engine(adapters, kernel=kernel, lora_mode=lora_mode, max_total_tokens=4096) as engine:
        first = {a: run(engine, prefix + [5, 6], a).new_token_ids for a in ("r8", "r64", None)}
        hits = memory(engine)["prefix_hit_tokens"]
        # Three adapters, one prefix: nothing crossed from one adapter's tree to another's.
        assert hits == 0
        follow = {a: prefix + [5, 6] + first[a] + [9, 10, 11] for a in first}
        second = {a: run(engine, follow[a], a).new_token_ids for a in first}
        mem = memory(engine)
        # Each follow-up reuses its own first turn's full blocks: (42 + 32 - 1) // 16 = 4.
        assert mem["prefix_hit_tokens"] - hits == 3 * 4 * 16
    for a in first:
        ref, margins = reference_greedy(tiny_model_dir, adapters, prefix + [5, 6], a)
        assert_same_greedy(first[a], ref, margins, f"first turn, adapter {a}")
        ref, margins = reference_greedy(tiny_model_dir, adapters, follow[a], a)
        assert_same_greedy(second[a], ref, margins, f"follow-up with reuse, adapter {a}")


def test_outputs_with_and_without_prefix_reuse_are_equal(tiny_engine, adapters):
    prompts = [([3 + i % 150 for i in range(70)] + [7, j], a) for j, a in
               enumerate(["r8", "r16", None, "r32", "r8", None])]  # fmt: skip
    outs = {}
    for on in (True, False):
        with tiny_engine(adapters, max_total_tokens=4096, prefix_cache=on) as engine:
            outs[on] = [run(engine, p, a).new_token_ids for p, a in prompts]
            hits = memory(engine)["prefix_hit_tokens"]
            assert (hits > 0) == on
            assert_memory_balanced(engine)
    assert outs[True] == outs[False]


def pool_sizes(tiny_engine, adapters: dict[str, str]) -> tuple[int, int, int]:
    """(bytes of a KV block, tokens of a KV block, blocks the adapters take) in an engine of the
    default configuration with these adapters."""
    with tiny_engine(adapters) as probe:
        adapter_blocks = sum(
            probe.memory.blocks_for_bytes(probe.lora.bytes_of(probe.resolve_adapter(n)))
            for n in adapters
        )
        return probe.kv.block_bytes, probe.kv.block_tokens, adapter_blocks


def test_kv_pressure_evicts_idle_adapters(tiny_engine, adapters):
    block_bytes, _, adapter_blocks = pool_sizes(tiny_engine, adapters)
    total = adapter_blocks + 12
    with tiny_engine(
        adapters, lora_mode="on-demand", memory_bytes=total * block_bytes, prefix_cache=False
    ) as engine:
        for name in adapters:  # every adapter cached and idle: the pool has 12 blocks free
            run(engine, [4, 5, 6], name, SamplingParams(max_new_tokens=2, temperature=0.0))
        assert memory(engine)["blocks"]["adapters_cached"] == adapter_blocks
        # KV for 240 tokens (15 blocks) and the base model: admitted, idle adapters make room.
        out = run(engine, [3 + i % 190 for i in range(200)], None, SamplingParams(max_new_tokens=40,
                                                                    ignore_eos=True))  # fmt: skip
        assert len(out.new_token_ids) == 40
        mem = memory(engine)
        assert mem["evictions_adapter"] >= 1
        assert_memory_balanced(engine)


def test_idle_kv_leaves_room_for_more_adapters_than_a_static_split(tiny_engine, adapters):
    adapters = {n: p for n, p in adapters.items() if n != "r64"}  # r8, r16, r32
    block_bytes, bt, adapter_blocks = pool_sizes(tiny_engine, adapters)
    budget = (adapter_blocks + 20) * block_bytes
    static_adapters = budget * 2 // 5  # 40% of it: room for the largest adapter alone
    configs = {
        "pool": dict(lora_mode="on-demand", memory_bytes=budget),
        "static": dict(
            lora_mode="on-demand",
            memory_layout="static",
            max_total_tokens=(budget - static_adapters) * bt // block_bytes,
            adapter_cache_bytes=static_adapters,
        ),
    }
    cached = {}
    for layout, fields in configs.items():
        with tiny_engine(adapters, **fields) as engine:
            for _ in range(2):
                for name in adapters:
                    run(engine, [4, 5, 6, 7], name, SamplingParams(max_new_tokens=3))
            snap = engine.counters().adapter_cache
            cached[layout] = (len(snap.resident), snap.misses)
    assert cached["pool"] == (len(adapters), len(adapters))  # all stay: one miss each
    assert cached["static"][0] < len(adapters) and cached["static"][1] > len(adapters)


def test_host_tier_swaps_blocks_out_and_back(tiny_engine):
    """A pool of 12 blocks: a second long prompt pushes the first one's cached blocks to the
    host; asking the first again copies them back, with the same tokens."""
    block_bytes, _, _ = pool_sizes(tiny_engine, {})
    with tiny_engine(memory_bytes=12 * block_bytes, host_memory_bytes=32 * block_bytes) as engine:
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        a, b = [3 + i % 90 for i in range(100)], [7 + i % 80 for i in range(100)]
        first = run(engine, a, None, params).new_token_ids
        run(engine, b, None, params)
        assert memory(engine)["swaps_out"] >= 1
        again = run(engine, a, None, params).new_token_ids
        mem = memory(engine)
        assert mem["swaps_in"] >= 1 and mem["prefix_hit_tokens"] >= 16
        assert again == first
        assert_memory_balanced(engine)


def test_soak_with_cancellations_leaks_no_block(tiny_engine, adapters):
    block_bytes, _, adapter_blocks = pool_sizes(tiny_engine, adapters)
    rng = random.Random(3)
    shared = [rng.randrange(3, 200) for _ in range(48)]
    with tiny_engine(
        adapters, lora_mode="on-demand", memory_bytes=(adapter_blocks // 2 + 70) * block_bytes,
        host_memory_bytes=16 * block_bytes, queue_policy="chameleon",
    ) as engine:  # fmt: skip
        handles = []
        for i in range(60):
            prompt = (shared if i % 2 else []) + [
                rng.randrange(3, 200) for _ in range(rng.choice((3, 20, 60)))
            ]
            params = SamplingParams(max_new_tokens=rng.choice((1, 8, 30)), temperature=0.7,
                                    seed=i, ignore_eos=True)  # fmt: skip
            adapter = rng.choice([None, *adapters])
            handles.append(
                engine.submit(GenerationRequest(prompt, params, engine.resolve_adapter(adapter)))
            )
            if i % 7 == 3:
                handles[rng.randrange(len(handles))].abort()
        for h in handles:
            h.result(timeout_s=300)
        mem = memory(engine)
        assert mem["prefix_hit_tokens"] > 0
        assert_memory_balanced(engine)


@pytest.mark.parametrize("lora_mode", ["on-demand", "cached"])
def test_an_adapter_loaded_again_under_its_name_never_reuses_the_old_ones_kv(
    tiny_model_dir, tiny_engine, adapters, lora_mode
):
    """Adapters are keyed by id: load A as "x", run a prompt (its blocks cached: the same prompt
    again reuses them), unload it, load B as "x": the prompt computes every token under B
    (cached_tokens 0) and gives transformers + PEFT's tokens for B."""
    prompt = [3 + i % 150 for i in range(50)]
    config = dict(lora_mode=lora_mode, max_total_tokens=4096)
    with tiny_engine({"x": adapters["r8"]}, **config) as engine:
        assert run(engine, prompt, "x").cached_tokens == 0
        assert run(engine, prompt, "x").cached_tokens == 48  # 3 full blocks of 16, reused
        old = engine.resolve_adapter("x")
        engine.remove_adapter("x")
        engine.add_adapter("x", adapters["r16"])
        assert engine.resolve_adapter("x").id != old.id
        again = run(engine, prompt, "x")
        assert_memory_balanced(engine)
    assert again.cached_tokens == 0
    ref, margins = reference_greedy(tiny_model_dir, adapters, prompt, "r16")
    assert_same_greedy(again.new_token_ids, ref, margins, "B loaded under A's name")


@pytest.mark.parametrize("lora_mode", ["on-demand", "cached"])
def test_an_adapter_loaded_again_under_its_name_never_gets_the_old_ones_rows(
    tiny_model_dir, tiny_engine, adapters, lora_mode, monkeypatch
):
    """The device adapter cache is keyed by id: with the purge on unload switched off, A's rows
    stay cached (idle) under "x" when B is loaded as "x"; B's requests still get B's rows
    (transformers + PEFT's tokens for B), and once A's entry is dropped nothing is held."""
    prompt = [3 + i % 150 for i in range(20)]
    with tiny_engine({"x": adapters["r8"]}, lora_mode=lora_mode, max_total_tokens=4096) as engine:
        cache = engine.lora.cache
        run(engine, prompt, "x")
        old = engine.resolve_adapter("x")
        monkeypatch.setattr(cache, "forget", lambda adapter_id: None)  # A stays on the device
        engine.remove_adapter("x")
        engine.add_adapter("x", adapters["r16"])
        again = run(engine, prompt, "x")
        assert cache.holds(old.id) and cache.holds(engine.resolve_adapter("x").id)
        monkeypatch.undo()
        cache.forget(old.id)
        assert_memory_balanced(engine, pinned_adapter_blocks=0)
    ref, margins = reference_greedy(tiny_model_dir, adapters, prompt, "r16")
    assert_same_greedy(again.new_token_ids, ref, margins, "B loaded under A's name")


def test_an_unloaded_adapter_takes_its_cached_prefixes_along(tiny_engine, adapters):
    """A new adapter under an old name must not find the old one's KV."""
    with tiny_engine({"x": adapters["r8"]}, lora_mode="on-demand", max_total_tokens=4096) as engine:
        prompt = [3 + i % 150 for i in range(50)]
        run(engine, prompt, "x")
        assert memory(engine)["blocks"]["kv_cached"] > 0
        engine.remove_adapter("x")
        assert memory(engine)["blocks"]["kv_cached"] == 0
        engine.add_adapter("x", adapters["r16"])
        hits = memory(engine)["prefix_hit_tokens"]
        run(engine, prompt, "x")
        assert memory(engine)["prefix_hit_tokens"] == hits
        assert_memory_balanced(engine)
