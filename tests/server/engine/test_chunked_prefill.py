"""Chunked prefill on the whole engine: mixed steps (decode rows and prompt chunks of different
adapters in one batch) give the greedy tokens of whole-prompt prefill and of transformers + PEFT
on each request alone, for prompts of several chunks, with prefix reuse, for every kernel and
LoRA mode (the near-tie rule of test_exactness). The engine is driven step by step, so the test
also sees its plans."""

from __future__ import annotations

import time

import pytest
import torch

from tests.server.engine.test_exactness import (
    NEW_TOKENS,
    assert_same_greedy,
    make_adapters,
    reference_greedy,
)
from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

BUDGET = 20  # tokens per step; with up to 12 decodes, prompt chunks of 8 to 20 tokens
ADAPTER_BYTES = 64 * (64 + 64) * 4 * 7 * 4  # rank 64, 7 projections of ~64x64, 4 layers, f32

# (kernel, lora mode, CPU workers): every kernel on resident adapters, and the modes that load
# adapters while requests run (cpu-assisted in process and with the worker pool).
SETUPS = [
    ("mbgmv", "cached", 0),
    ("bgmv", "cached", 0),
    ("mbgmv", "on-demand", 0),
    ("mbgmv", "cpu-assisted", 0),
    ("bgmv", "cpu-assisted", 2),
]


def first_round(vocab: int) -> list[tuple[list[int], str | None]]:
    """Prompts of 2 to 5 chunks, four adapters and the base model."""
    gen = torch.Generator().manual_seed(7)
    names = ["r8", "r16", "r32", "r64", None, "r8"]
    lengths = [45, 70, 33, 88, 52, 61]
    return [(torch.randint(3, vocab, (n,), generator=gen).tolist(), a)
            for n, a in zip(lengths, names)]  # fmt: skip


def second_round(first: list[tuple[list[int], str | None]], vocab: int):
    """Prompts that start with (up to) 48 tokens of a first-round prompt under the same adapter
    (its full KV blocks are reused) and go on for 20 to 40 new tokens (one to several chunks)."""
    gen = torch.Generator().manual_seed(8)
    return [(prompt[:48] + torch.randint(3, vocab, (n,), generator=gen).tolist(), a)
            for (prompt, a), n in zip(first, [20, 33, 40, 25])]  # fmt: skip


def run_engine(model_dir, adapters, rounds, kernel, mode, workers, chunked: bool):
    config = EngineConfig(
        dtype="float32", kernel=kernel, lora_mode=mode, max_total_tokens=4096, max_batch_size=12,
        num_cpu_workers=workers, chunked_prefill=chunked, max_num_batched_tokens=BUDGET,
        link_gbps=ADAPTER_BYTES * 8 / 0.5 / 1e9 if mode != "cached" else 0.0,
        layers_per_group=1,
    )  # fmt: skip
    engine = build_engine(str(model_dir), config, adapters)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs, plans = [], []
    try:
        for prompts in rounds:
            handles = [engine.submit(GenerationRequest(list(p), params, a)) for p, a in prompts]
            deadline = time.monotonic() + 300
            while (plan := engine.step()) is not None or engine.scheduler.has_work():
                assert time.monotonic() < deadline
                if plan is None:
                    time.sleep(0.005)  # an adapter is loading (on-demand waits for it)
                else:
                    plans.append(plan)
            outputs += [h.result(timeout_s=5).new_token_ids for h in handles]
        stats = engine.stats().to_json()
        prefix_hits = engine.memory.counters.prefix_hit_tokens
        host_calls = engine.lora.host_stats.calls
    finally:
        engine.shutdown()
    assert stats["running"] == [] and stats["queue"] == []
    assert stats["free_kv_tokens"] == stats["max_total_tokens"]
    return outputs, plans, prefix_hits, host_calls


@pytest.mark.parametrize(("kernel", "mode", "workers"), SETUPS)
def test_chunked_matches_unchunked_and_peft(tmp_path_factory, kernel, mode, workers):
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny"), num_layers=4)
    adapters = make_adapters(tmp_path_factory.mktemp("adapters"), model_dir)
    first = first_round(200)
    rounds = [first, second_round(first, 200)]
    chunked, plans, hits, host_calls = run_engine(
        model_dir, adapters, rounds, kernel, mode, workers, chunked=True
    )
    whole, whole_plans, _, _ = run_engine(
        model_dir, adapters, rounds, kernel, mode, workers, chunked=False
    )
    assert not any(p.is_mixed for p in whole_plans)
    # Mixed steps happened: decode rows beside prompt chunks that sample nothing yet, of
    # several adapters, within the budget; the prefix of the second round was reused.
    mixed = [p for p in plans if p.is_mixed]
    assert all(sum(p.chunks) <= BUDGET for p in mixed)
    assert any(
        not all(p.samples)
        and any(s.output_ids and n == 1 for s, n in zip(p.seqs, p.chunks))
        and len({s.request.adapter for s in p.seqs}) > 1
        for p in mixed
    )
    assert hits == sum(min(len(p), 48) // 16 * 16 for p, _ in first[:4])  # whole blocks
    if mode == "cpu-assisted":
        assert host_calls > 0, "no layer ran on the host: the loads were not in flight"
    for (prompt, name), got, want in zip([p for r in rounds for p in r], chunked, whole):
        ref, margins = reference_greedy(model_dir, adapters, prompt, name)
        what = f"{kernel}/{mode}, adapter {name}, prompt of {len(prompt)}"
        assert_same_greedy(got, ref, margins, what + " (chunked vs PEFT)")
        assert_same_greedy(got, want, margins, what + " (chunked vs whole-prompt prefill)")
