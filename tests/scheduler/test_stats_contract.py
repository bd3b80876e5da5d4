"""The /stats contract between server and scheduler: a live server's body, as the scheduler
reads it (`ServerStats.from_json`, then `ServerState.from_stats`)."""

from __future__ import annotations

import time

import pytest

from tests.server.api.test_api import start_engine
from toppings.scheduler.state import ServerState
from toppings.server.api.app import create_app
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.requests.stats_schema import RequestView, ServerStats


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model_dir):
    with start_engine(tmp_path_factory.mktemp("contract_adapters"), tiny_model_dir) as eng:
        yield eng


def test_a_busy_servers_stats_parse_on_the_scheduler_side(engine, monkeypatch):
    forward = engine.model.forward

    def slow_forward(*args, **kwargs):  # keeps the request running while /stats is read
        time.sleep(0.005)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", slow_forward)
    client = create_app(engine).test_client()
    params = SamplingParams(max_new_tokens=engine.max_model_len - 4, temperature=0.0,
                            ignore_eos=True)  # fmt: skip
    handle = engine.submit(GenerationRequest([5, 6, 7], params, engine.resolve_adapter("a16")))
    try:
        deadline = time.monotonic() + 60
        while not engine.stats().running:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        body = client.get("/stats").get_json()
    finally:
        handle.abort()
    stats = ServerStats.from_json(body)
    assert stats.to_json() == body  # nothing lost or renamed on the way
    assert stats.running[0] == RequestView(
        id=stats.running[0].id, adapter="a16", rank=16, prompt_tokens=3,
        output_tokens=stats.running[0].output_tokens, max_new_tokens=params.max_new_tokens,
    )  # fmt: skip
    assert {a.name: a.rank for a in stats.adapters} == {"a8": 8, "a16": 16}
    state = ServerState.from_stats("http://s", body)
    assert state.num_running == 1 and state.healthy and state.kernel == engine.config.kernel
    assert state.adapters == {"a8", "a16"} and state.base_model == engine.model_name
    assert state.batch.max_rank == 16


def test_malformed_stats_are_refused():
    good = {"model": "m", "kernel": "mbgmv", "device": "cpu", "lora_mode": "cached",
            "running": [], "queue": [], "adapters": [], "free_kv_tokens": 10,
            "max_total_tokens": 10, "healthy": True}  # fmt: skip
    assert ServerStats.from_json(dict(good, newer_field=1)).extra == {"newer_field": 1}
    for bad in (dict(good, kernel="x"), {k: v for k, v in good.items() if k != "running"},
                dict(good, running=[{"id": "r"}]), [good]):  # fmt: skip
        with pytest.raises((KeyError, TypeError, ValueError)):
            ServerStats.from_json(bad)
