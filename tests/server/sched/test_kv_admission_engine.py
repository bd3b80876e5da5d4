"""--kv-admission in a live engine (tiny random Llama, float32): with expected reservations more
requests run at once than with worst-case ones, the ones that outgrow theirs preempt the
youngest, which resumes where it was; the tokens are those of worst-case admission, each sent
once, and the memory is all given back."""

from __future__ import annotations

import time

import pytest

from tests.helpers import assert_memory_balanced
from toppings.server.requests.request import GenerationRequest, SamplingParams

BLOCK = 16
POOL = 20 * BLOCK  # 20 blocks: two requests of 10 + 100 tokens fit at worst case, not three


def short_history(engine) -> None:
    """Eight requests that stop at their first token (it may only be the EOS): the predictor
    learns that this server's requests use 1/100 of their max_tokens."""
    eos = [min(engine.eos_ids)]
    params = SamplingParams(max_new_tokens=100, temperature=0.0, allowed_token_ids=eos)
    for i in range(8):
        engine.submit(GenerationRequest([3 + i, 4, 5], params)).result(timeout_s=60)


def long_requests(engine, temperature: float):
    """Six requests that run their whole 100 tokens (EOS ignored; a stop string that does not
    come keeps them from being certain to): each outgrows what the history expects of it."""
    params = SamplingParams(
        max_new_tokens=100, temperature=temperature, ignore_eos=True, stop=["never said"]
    )
    prompts = [[10 + i, 20 + i, 30, 40, 50, 60, 70, 80, 90, 11 + i] for i in range(6)]
    return [engine.submit(GenerationRequest(p, params)) for p in prompts]


def run(tiny_engine, admission: str, temperature: float = 0.0, async_scheduling=False):
    with tiny_engine(
        None, max_total_tokens=POOL, block_tokens=BLOCK, kv_admission=admission,
        max_batch_size=8, async_scheduling=async_scheduling,
    ) as engine:  # fmt: skip
        short_history(engine)
        handles = long_requests(engine, temperature)
        streams: list[list] = [[] for _ in handles]
        most_running = 0
        while not all(s and s[-1].finish_reason for s in streams):
            most_running = max(most_running, len(engine.stats().to_json()["running"]))
            for stream, handle in zip(streams, handles):
                stream.extend(handle.poll())
            time.sleep(0.002)
        preemptions = engine.scheduler.preemptions
        assert_memory_balanced(engine)
    return streams, most_running, preemptions


def ids_of(stream) -> list[int]:
    return [t for out in stream for t in out.new_token_ids]


@pytest.mark.parametrize("async_scheduling", [False, True])  # True: planned ahead (GPU's)
def test_expected_reservations_run_more_at_once_and_resume_exactly(tiny_engine, async_scheduling):
    worst, worst_running, worst_preempted = run(tiny_engine, "worst-case")
    expected, expected_running, preempted = run(
        tiny_engine, "expected", async_scheduling=async_scheduling
    )
    assert worst_preempted == 0 and worst_running <= 2
    assert expected_running > 2 and preempted > 0  # more at once; the long ones preempted
    assert [ids_of(s) for s in expected] == [ids_of(s) for s in worst]
    assert ["".join(o.new_text for o in s) for s in expected] == [
        "".join(o.new_text for o in s) for s in worst
    ]
    assert all(s[-1].finish_reason == "length" for s in expected)


def test_a_preempted_random_request_streams_one_output(tiny_engine):
    """An unseeded random request resumes after the tokens it sent: its stream is one output
    of max_tokens tokens (none sent twice, none dropped) whose text is its tokens' text."""
    streams, _, preempted = run(tiny_engine, "expected", temperature=0.9)
    assert preempted > 0
    for stream in streams:
        final = stream[-1]
        assert len(ids_of(stream)) == final.output_tokens == 100
        assert final.finish_reason == "length"
