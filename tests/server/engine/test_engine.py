"""Engine behaviour on a tiny random Llama: batching invariance, sampling, stops, aborts, leaks."""

from __future__ import annotations

import pytest

from tests.helpers import assert_memory_balanced, wait_steps_back
from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(
    params=[(False, False), (True, False), (False, True), (True, True)],
    ids=["sync", "async", "sync-output-thread", "async-output-thread"],
)
def engine(tiny_engine, request):
    """Every behaviour holds with async scheduling too (the model on the device lane's thread,
    the next step planned while it runs: server/engine/step_pipeline.py), and with the outputs
    made on the output processor's thread (server/engine/output_processor.py)."""
    async_scheduling, output_thread = request.param
    with tiny_engine(
        max_total_tokens=2048, async_scheduling=async_scheduling, output_thread=output_thread
    ) as eng:
        yield eng


def generate(engine, prompt, params=GREEDY, adapter=None):
    return engine.submit(
        GenerationRequest(list(prompt), params, engine.resolve_adapter(adapter))
    ).result(timeout_s=120)


def assert_idle(engine):
    wait_steps_back(engine)
    stats = engine.stats().to_json()
    assert stats["running"] == [] and stats["queue"] == []
    assert stats["free_kv_tokens"] == stats["max_total_tokens"]
    assert_memory_balanced(engine)


def test_greedy_output_does_not_depend_on_the_batch(engine):
    alone = generate(engine, [5, 6, 7, 8]).new_token_ids
    handles = [
        engine.submit(GenerationRequest(p, GREEDY))
        for p in ([9, 10], [5, 6, 7, 8], [11] * 20, [12, 13, 14])
    ]
    together = [h.result(timeout_s=120).new_token_ids for h in handles]
    assert together[1] == alone
    assert len(alone) == 12
    assert_idle(engine)


def test_seeded_sampling_repeats_in_any_batch(engine):
    params = SamplingParams(
        max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True
    )
    first = generate(engine, [3, 4, 5], params).new_token_ids
    others = [
        engine.submit(
            GenerationRequest(
                [20 + i],
                params.__class__(max_new_tokens=10, temperature=1.0, seed=i, ignore_eos=True),
            )
        )
        for i in range(3)
    ]
    again = generate(engine, [3, 4, 5], params).new_token_ids
    for h in others:
        h.result(timeout_s=120)
    assert first == again


def test_streaming_delivers_every_token_then_one_final_output(engine):
    handle = engine.submit(GenerationRequest([1, 2, 3], GREEDY))
    outputs = list(handle.events(timeout_s=120))
    assert [o.finish_reason for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    assert outputs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outputs) == 12
    assert len(outputs) >= 2
    assert outputs[-1].ttft_s is not None and outputs[-1].e2e_s >= outputs[-1].ttft_s


def test_stop_string_cuts_the_text(engine):
    full = generate(
        engine, [40, 41, 42], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    )
    text = full.new_text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"generated text too short to test stop strings: {text!r}"
    cut = generate(
        engine,
        [40, 41, 42],
        SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)),
    )
    assert cut.finish_reason == "stop"
    assert cut.new_text == text[: text.find(stop)]
    assert_idle(engine)


def test_eos_ends_the_request(engine):
    first = generate(engine, [50, 51]).new_token_ids
    engine.eos_ids.add(first[3])  # pretend the 4th greedy token is EOS
    try:
        out = generate(engine, [50, 51], SamplingParams(max_new_tokens=12, temperature=0.0))
    finally:
        engine.eos_ids.discard(first[3])
    assert out.finish_reason == "stop"
    assert out.new_token_ids == first[: first.index(first[3]) + 1]


def test_abort_frees_the_request(engine):
    handle = engine.submit(
        GenerationRequest(
            [1] * 10, SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        )
    )
    events = handle.events(timeout_s=120)
    assert next(events).finish_reason is None
    handle.abort()
    reasons = [o.finish_reason for o in events]
    assert reasons[-1] == "abort"
    assert_idle(engine)


def test_abort_all_ends_what_runs_and_waits(tiny_engine):
    """A drain out of time: every request running or queued ends with "abort", nothing held."""
    with tiny_engine(max_total_tokens=1024, max_batch_size=2) as eng:
        params = SamplingParams(max_new_tokens=490, temperature=0.0, ignore_eos=True)
        handles = [eng.submit(GenerationRequest([1] * 10, params)) for _ in range(3)]
        streams = [h.events(timeout_s=120) for h in handles]
        assert next(streams[0]).finish_reason is None  # running (the third one waits)
        eng.abort_all()
        for stream in streams:
            assert [o.finish_reason for o in stream][-1] == "abort"
        assert_idle(eng)


def test_requests_beyond_the_kv_budget_wait_and_all_finish(tiny_engine):
    with tiny_engine(max_total_tokens=64) as eng:
        params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
        handles = [eng.submit(GenerationRequest([7] * 20, params)) for _ in range(6)]
        results = [h.result(timeout_s=120) for h in handles]
        assert all(len(r.new_token_ids) == 20 for r in results)
        assert len({tuple(r.new_token_ids) for r in results}) == 1
        assert_idle(eng)


@pytest.mark.parametrize(
    ("prompt", "params", "adapter", "code"),
    [
        ([1, 2], GREEDY, "no-such-adapter", 404),
        ([], GREEDY, None, 400),
        ([1, 10**9], GREEDY, None, 400),
        ([1] * 500, SamplingParams(max_new_tokens=100), None, 400),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(
    engine, prompt, params, adapter, code
):
    with pytest.raises(RequestError) as err:
        engine.submit(GenerationRequest(prompt, params, engine.resolve_adapter(adapter)))
    assert err.value.code == code
    assert len(generate(engine, [1, 2, 3]).new_token_ids) == 12


def test_sampling_params_are_validated():
    for bad in (
        dict(max_new_tokens=0),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_k=-2),
        dict(stop=("",)),
        dict(max_new_tokens="3"),
    ):
        with pytest.raises(RequestError):
            SamplingParams(**bad)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_spin_us", -1.0),
        ("num_cpu_workers", -1),
        ("link_gbps", -0.5),
        ("lora_mode", "x"),
        ("cpu_worker_timeout", 0.0),
    ],
)
def test_engine_config_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
    with pytest.raises(ValueError, match="--cpu-worker-timeout must be a finite"):
        EngineConfig(cpu_worker_timeout=float("inf"))


def test_requests_submitted_together_share_one_prefill_or_none_is_queued(engine):
    before = engine.step_stats.prefill_steps
    handles = engine.submit_all([GenerationRequest([5, 6, 7], GREEDY),
                                 GenerationRequest([9, 10], GREEDY)])  # fmt: skip
    assert all(len(h.result(timeout_s=120).new_token_ids) == 12 for h in handles)
    assert engine.step_stats.prefill_steps - before == 1
    with pytest.raises(RequestError):
        engine.submit_all([GenerationRequest([5, 6], GREEDY), GenerationRequest([], GREEDY)])
    assert_idle(engine)
    assert engine.stats().to_json()["queue"] == []


def test_each_engine_keeps_its_own_thread_count_beside_another(tiny_engine, monkeypatch):
    """Two engines in one process, built before either runs: each step runs on the thread count
    of its own engine (ATen would otherwise hand the first engine's thread the count the second
    engine set last, at its first parallel op). The forward each engine runs while it is built
    (step_timing.warm_forward, on the building thread) is not a step."""
    import threading

    import torch

    from toppings.server.model.llama import LlamaModel

    seen: dict[int, set[int]] = {}
    forward = LlamaModel.forward

    def spy(self, batch, kv):
        if threading.current_thread() is not threading.main_thread():
            seen.setdefault(id(self), set()).add(torch.get_num_threads())
        return forward(self, batch, kv)

    monkeypatch.setattr(LlamaModel, "forward", spy)
    with (
        tiny_engine(max_total_tokens=512, num_threads=2) as two,
        tiny_engine(max_total_tokens=512, num_threads=1) as one,
    ):
        for eng in (two, one):
            generate(eng, [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert [seen[id(eng.model)] for eng in (two, one)] == [{2}, {1}]
