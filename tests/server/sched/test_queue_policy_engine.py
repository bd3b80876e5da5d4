"""Queue policies in a live engine (tiny random Llama): admission order changes, tokens do not."""

from __future__ import annotations

import random
import time

import pytest

from tests.helpers import assert_memory_balanced, running_engine
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.requests.request import GenerationRequest, SamplingParams

RANKS = (8, 16, 32, 64)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("queue_adapters")
    return {
        f"r{r}": str(make_random_adapter(root / f"r{r}", tiny_model_dir, rank=r, seed=r))
        for r in RANKS
    }


def workload(n: int = 48):
    """Mixed lengths and adapters; greedy and seeded sampling."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 200) for _ in range(rng.choice((4, 8, 40, 90)))]
        params = SamplingParams(
            max_new_tokens=rng.choice((2, 4, 24, 60)),
            temperature=0.0 if i % 2 else 0.8,
            seed=None if i % 2 else i,
            ignore_eos=True,
        )
        out.append((prompt, params, rng.choice([None, *(f"r{r}" for r in RANKS)])))
    return out


def run(tiny_model_dir, adapters, policy: str):
    # A small KV cache (4 long requests at a time) so that requests queue and the order matters.
    with running_engine(
        tiny_model_dir, adapters, max_total_tokens=600, queue_policy=policy
    ) as engine:
        handles = [
            engine.submit(GenerationRequest(p, s, engine.resolve_adapter(a)))
            for p, s, a in workload()
        ]
        tokens = [h.result(timeout_s=300).new_token_ids for h in handles]
        return tokens, engine.stats().to_json()["queueing"]


def test_chameleon_changes_the_order_not_the_tokens(tiny_model_dir, adapters):
    fcfs, fcfs_view = run(tiny_model_dir, adapters, "fcfs")
    chameleon, view = run(tiny_model_dir, adapters, "chameleon")
    assert chameleon == fcfs
    assert fcfs_view["policy"] == "fcfs"
    assert view["policy"] == "chameleon" and view["refreshes"] >= 1
    assert len(view["quotas"]) == len(view["cutoffs"]) + 1 == len(view["queue_lengths"])


def test_a_squashed_request_streams_each_token_once(tiny_engine, adapters):
    with tiny_engine(adapters, max_total_tokens=600, queue_policy="chameleon") as engine:
        params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=3, ignore_eos=True)
        alone = engine.submit(
            GenerationRequest([5, 6, 7], params, engine.resolve_adapter("r32"))
        ).result(timeout_s=120)
        forward = engine.model.forward

        def slow_forward(*args, **kwargs):  # 5 ms a step: the request is caught mid-run
            time.sleep(0.005)
            return forward(*args, **kwargs)

        engine.model.forward = slow_forward
        handle = engine.submit(GenerationRequest([5, 6, 7], params, engine.resolve_adapter("r32")))
        deadline = time.monotonic() + 60
        while True:
            with engine._lock:
                seq = next(iter(engine.scheduler.running), None)
                if seq is not None and len(seq.output_ids) >= 5:
                    engine.queue.squash(seq, engine.scheduler.gate())
                    break
            assert time.monotonic() < deadline, "the request never ran 5 steps"
            time.sleep(0.001)
        outputs = list(handle.events(timeout_s=120))
        streamed = [t for o in outputs for t in o.new_token_ids]
        assert streamed == alone.new_token_ids
        assert "".join(o.new_text for o in outputs) == alone.new_text
        assert engine.stats().to_json()["queueing"]["squashes"] == 1
        assert_memory_balanced(engine)


@pytest.mark.parametrize(
    "layout, budget, charged",
    [("pool", {}, False), ("pool", {"adapter_cache_bytes": 4 << 20}, True),
     ("static", {}, False), ("static", {"adapter_cache_bytes": 4 << 20}, True)],
)  # fmt: skip
def test_a_request_is_charged_its_adapter_only_where_adapter_memory_counts(
    tiny_engine, adapters, layout, budget, charged
):
    # Chameleon's quota charge includes the adapter's memory only where the engine's memory
    # counts it; otherwise a large adapter's request looks larger than the whole memory and
    # its queue serialises (found by bench_queueing after the pool became the default).
    with tiny_engine(
        adapters, max_total_tokens=600, queue_policy="chameleon", memory_layout=layout, **budget
    ) as engine:
        gate = engine.scheduler.gate()
        assert gate.adapter_tokens(None) == 0
        assert (gate.adapter_tokens(engine.resolve_adapter("r64")) > 0) is charged
        if charged:
            assert gate.adapter_tokens(engine.resolve_adapter("r64")) > gate.adapter_tokens(
                engine.resolve_adapter("r8")
            )


def test_reloads_of_an_adapter_leave_no_history_in_the_chameleon_predictor(
    tiny_model_dir, adapters
):
    """Each load makes a new reference; an unload drops the predictor's history of the old one
    (it kept one entry per reload for as long as the server ran: issue 48's soak)."""
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    with running_engine(tiny_model_dir, queue_policy="chameleon") as engine:
        for _ in range(5):
            engine.add_adapter("r8", adapters["r8"])
            ref = engine.resolve_adapter("r8")
            out = engine.submit(GenerationRequest([5, 6, 7], params, ref)).result(timeout_s=60)
            assert out.finish_reason == "length"
            assert engine.queue.predictor.num_adapters == 1  # this reference's history
            engine.remove_adapter("r8")
        assert engine.queue.predictor.num_adapters == 0
