"""One request's trouble stays its own: an unload racing a submission, a fault in admission or in
a step fails at most the requests concerned, and the engine thread keeps serving the rest."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import assert_memory_balanced
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("isolation") / "a"
    return make_random_adapter(out, tiny_model_dir, rank=8, target_modules=("q_proj", "v_proj"))


@pytest.fixture(params=["fcfs", "chameleon"])
def engine(request, tiny_engine, adapter_dir):
    with tiny_engine(max_total_tokens=2048, queue_policy=request.param) as eng:
        eng.add_adapter("a", str(adapter_dir))
        yield eng


def submit(engine, adapter=None, prompt=(5, 6, 7)):
    return engine.submit(GenerationRequest(list(prompt), GREEDY, engine.resolve_adapter(adapter)))


def test_an_unload_racing_a_submission_is_refused_and_the_request_served(engine, monkeypatch):
    checked = threading.Event()
    check = engine._check

    def slow_check(request):  # widen the window between the adapter check and the queueing
        check(request)
        checked.set()
        threading.Event().wait(0.3)

    monkeypatch.setattr(engine, "_check", slow_check)
    refused: list[RequestError] = []

    def unload():
        checked.wait(5)
        try:
            engine.remove_adapter("a")
        except RequestError as exc:
            refused.append(exc)

    unloader = threading.Thread(target=unload)
    unloader.start()
    handle = submit(engine, "a")
    unloader.join(10)
    out = handle.result(timeout_s=60)
    assert [e.code for e in refused] == [409]
    assert out.finish_reason == "length" and len(out.new_token_ids) == 6
    assert engine.is_healthy()
    engine.remove_adapter("a")  # once its request ended, the unload goes through
    assert submit(engine).result(timeout_s=60).finish_reason == "length"


def test_a_fault_in_one_requests_admission_fails_that_request_alone(engine, monkeypatch):
    acquire = engine.lora.acquire

    def faulty(adapter):
        if adapter.name == "a":
            raise RuntimeError("injected admission fault")
        return acquire(adapter)

    monkeypatch.setattr(engine.lora, "acquire", faulty)
    handles = [submit(engine), submit(engine, "a"), submit(engine, prompt=(9, 10))]
    outs = [h.result(timeout_s=60) for h in handles]
    assert outs[1].finish_reason == "error" and "injected admission fault" in outs[1].error
    assert [outs[0].finish_reason, outs[2].finish_reason] == ["length", "length"]
    assert engine.is_healthy()
    monkeypatch.setattr(engine.lora, "acquire", acquire)
    assert submit(engine, "a").result(timeout_s=60).finish_reason == "length"
    assert_memory_balanced(engine)


def test_a_fault_in_a_step_fails_that_step_and_the_engine_goes_on(engine, monkeypatch):
    run = engine.runner.run
    faults = iter([RuntimeError("injected step fault")])

    def faulty(plan):
        fault = next(faults, None)
        if fault is not None:
            raise fault
        return run(plan)

    monkeypatch.setattr(engine.runner, "run", faulty)
    failed = submit(engine, "a").result(timeout_s=60)
    assert failed.finish_reason == "error" and "injected step fault" in failed.error
    later = [submit(engine, "a"), submit(engine)]
    assert [h.result(timeout_s=60).finish_reason for h in later] == ["length", "length"]
    assert engine.is_healthy()
    engine.remove_adapter("a")  # the failed request gave its adapter back
    assert_memory_balanced(engine)
