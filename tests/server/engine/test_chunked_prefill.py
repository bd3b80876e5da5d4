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
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

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


def build_engine(model_dir, config: EngineConfig, adapters: dict[str, str]) -> Engine:
    """An engine whose thread is not started: the test runs its steps (`Engine.step`)."""
    engine = Engine(config, load_checkpoint(str(model_dir)))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


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
            handles = [
                engine.submit(GenerationRequest(list(p), params, engine.resolve_adapter(a)))
                for p, a in prompts
            ]
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
    # unchunked: every prompt whole in its step (each samples), decodes beside it
    assert all(all(p.samples) for p in whole_plans)
    # Mixed steps happened: decode rows beside prompt chunks that sample nothing yet, of
    # several adapters, within the budget; the prefix of the second round was reused.
    mixed = [p for p in plans if p.is_prefill]
    assert all(sum(p.tokens) <= BUDGET for p in mixed)
    assert any(
        not all(p.samples)
        and any(s.output_ids and n == 1 for s, n in zip(p.seqs, p.tokens))
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


def test_logprobs_exact_in_mixed_steps(tmp_path_factory, tiny_model_dir):
    """Output logprobs of decode rows run in mixed steps, and the prompt logprobs of requests
    that score their prompt (in chunks beside others' chunks and decodes, each chunk's rows
    scored as it is computed), equal transformers + PEFT's (test_logprobs_exactness's
    tolerance)."""
    from tests.server.engine.test_logprobs_exactness import TOP, check_against_reference

    adapters = make_adapters(tmp_path_factory.mktemp("adapters_lp"), tiny_model_dir)
    config = EngineConfig(
        dtype="float32", max_total_tokens=4096, max_batch_size=12, chunked_prefill=True,
        max_num_batched_tokens=BUDGET,
    )  # fmt: skip
    engine = build_engine(str(tiny_model_dir), config, adapters)
    long = first_round(200)
    gen = torch.Generator().manual_seed(9)
    scored = [(torch.randint(3, 200, (n,), generator=gen).tolist(), a)
              for n, a in [(30, "r16"), (9, None), (14, "r64")]]  # fmt: skip
    plain = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    scoring = SamplingParams(
        max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP
    )
    plans = []
    try:
        handles = [
            engine.submit(GenerationRequest(list(p), plain, engine.resolve_adapter(a)))
            for p, a in long[:3]
        ]
        plans.append(engine.step())  # the long prompts start; the scored ones come beside them
        scored_handles = [
            engine.submit(GenerationRequest(list(p), scoring, engine.resolve_adapter(a)))
            for p, a in scored
        ]
        while engine.scheduler.has_work() or not plans[-1]:
            plans.append(engine.step())
        results = [h.result(timeout_s=5) for h in scored_handles]
        for h in handles:
            h.result(timeout_s=5)
    finally:
        engine.shutdown()
    assert any(p is not None and p.is_prefill and not all(p.samples) for p in plans)
    chunks = [n for p in plans if p is not None for s, b, n in zip(p.seqs, p.starts, p.tokens)
              if s.request.prompt_ids == scored[0][0] and b < 30]  # fmt: skip
    assert len(chunks) > 1 and sum(chunks) == 30  # the 30-token scored prompt went in chunks
    check_against_reference(tiny_model_dir, adapters, scored, results)


def test_long_prompt_does_not_stall_32_decoding_streams(tmp_path_factory):
    """The stall test on the engine, in step terms (the stated target: every stream gets one
    token per step): a 1,000-token prompt arrives while 32 streams decode, budget 64 tokens.
    Every step until its first token gives each stream a token, and the prompt is spread over
    ceil(1000 / (64 - 32)) steps (the 32 decodes take their 32 tokens of each step first)."""
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny_long"), max_position_embeddings=2048)
    config = EngineConfig(
        dtype="float32", max_total_tokens=8192, max_batch_size=33, chunked_prefill=True,
        max_num_batched_tokens=64,
    )  # fmt: skip
    engine = build_engine(str(model_dir), config, {})
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    try:
        for _ in range(32):
            engine.submit(
                GenerationRequest(torch.randint(3, 200, (8,), generator=gen).tolist(), params)
            )
        while len(engine.scheduler.running) < 32 or not all(
            s.output_ids for s in engine.scheduler.running
        ):
            engine.step()
        decoding = list(engine.scheduler.running)
        long_prompt = torch.randint(3, 200, (1000,), generator=gen).tolist()
        engine.submit(GenerationRequest(long_prompt, SamplingParams(max_new_tokens=2)))
        steps = 0
        while True:
            before = [len(s.output_ids) for s in decoding]
            plan = engine.step()
            steps += 1
            assert [len(s.output_ids) for s in decoding] == [n + 1 for n in before]
            assert sum(plan.tokens) <= 64
            if any(s.prompt_len == 1000 and s.output_ids for s in plan.seqs):
                break
        assert steps == -(-1000 // 32)
    finally:
        engine.shutdown()


def test_decode_rows_with_a_long_past_attend_natively(monkeypatch):
    """A decode row and a short prompt chunk of a mixed step, each after a long past, go to
    the native rows kernel, a chunk of more new tokens than TILE_MIN_LEN to the blocked one;
    all agree with SDPA."""
    from toppings.server import native
    from toppings.server.model import attention

    if native.library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(attention, "TILE_MIN_LEN", 24)
    monkeypatch.setattr(attention, "TILE_MIN_WORK", 0)
    gen = torch.Generator().manual_seed(5)
    # a decode row after 40 past tokens, a chunk of 3 after 30, a chunk of 26 after 10
    seg_starts = [0, 1, 4, 30]
    num_tokens, num_slots = seg_starts[-1], 120
    q = torch.randn(num_tokens, 6, 16, generator=gen)
    key, val = torch.randn(num_tokens, 2, 16, generator=gen), torch.randn(num_tokens, 2, 16)
    k_cache, v_cache = torch.randn(2, num_slots, 16, generator=gen), torch.randn(2, num_slots, 16)
    perm = torch.randperm(num_slots, generator=gen)
    slots = perm[:num_tokens]
    k_cache[:, slots], v_cache[:, slots] = key.transpose(0, 1), val.transpose(0, 1)
    past = perm[num_tokens:]
    past_slots = [past[:40], past[40:70], past[70:80]]
    plan = attention.plan_prefill(seg_starts, past_slots, slots)
    assert plan.tiles.tolist() == [[4, 26, 74, 10]] and plan.has_rows
    args = (q, key, val, seg_starts, past_slots, k_cache, v_cache)
    got = attention.prefill_attention(*args, plan)
    want = attention.prefill_attention(*args)  # every segment through SDPA
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
])])  # fmt: skip
def test_graphs_serve_the_pure_decode_steps(tiny_model_dir, tmp_path_factory, device):
    """With chunked prefill, every pure-decode step goes to the decode graphs (on a CPU the
    padded forward of test_cuda_graphs' stand-in) and mixed steps run eagerly; the tokens are
    those of the same chunked engine without graphs."""
    from tests.server.model.test_cuda_graphs import JOBS, assert_same, generate, start

    adapters = make_adapters(tmp_path_factory.mktemp("graph_chunk_adapters"), tiny_model_dir)
    outputs = {}
    for graphs in (False, True):
        with start(tiny_model_dir, adapters, device, graphs, chunked_prefill=True,
                   max_num_batched_tokens=BUDGET) as engine:  # fmt: skip
            outputs[graphs] = generate(engine, JOBS)
            stats = engine.step_stats
            if graphs:
                counters = engine.runner.graphs.counters.copy()
    assert stats.prefill_steps > 1  # the prompts (100 tokens) were spread over mixed steps
    assert counters.replays == stats.decode_steps > 0, counters
    assert_same(tiny_model_dir, adapters, JOBS, outputs[True], outputs[False])
