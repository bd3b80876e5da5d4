"""The /stats contract between server and scheduler: a live server's body, as the scheduler
reads it (`ServerStats.from_json`, then `ServerState.from_stats`)."""

from __future__ import annotations

import copy
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


def test_the_scheduler_asks_for_the_adapter_list_only_when_it_changed(
    engine, tmp_path, scheduler_parts, tiny_model_dir
):
    """The cluster's polls send back the last `adapters_version`: while no adapter was
    registered or dropped the server leaves its list out (and builds none), and the cluster
    routes on the list it holds, with each poll's residency; a load moves the version and the
    next poll has the whole list again."""
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.server.api.options import ApiOptions

    root = tmp_path / "loras"
    make_random_adapter(root / "late", tiny_model_dir, rank=4, seed=7)
    client = create_app(engine, ApiOptions(lora_roots=(str(root),))).test_client()
    bodies: list[tuple[str, dict]] = []

    def fetch(url: str) -> dict:
        path = url.removeprefix("http://s")
        body = client.get(path).get_json()
        bodies.append((path, copy.deepcopy(body)))  # as sent: the cluster fills in its own
        return body

    with scheduler_parts(tmp_path, fetch) as (_, cluster, _):
        cluster.add_server("http://s")
        cluster.refresh("http://s")  # the first poll: the whole list
        version = bodies[-1][1]["adapters_version"]
        assert bodies[-1][0] == "/stats" and len(bodies[-1][1]["adapters"]) == 2
        cluster.refresh("http://s")
        path, body = bodies[-1]
        assert path == f"/stats?adapters_since={version}"
        assert body["adapters_unchanged"] is True and body["adapters"] == []
        (state,) = cluster.states()
        assert state.adapters == {"a8", "a16"}
        assert state.device_adapters == set(body["resident_adapters"])
        loaded = client.post(
            "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")}
        )
        assert loaded.status_code == 200, loaded.get_data(as_text=True)
        try:
            cluster.refresh("http://s")
            body = bodies[-1][1]
            assert body["adapters_version"] != version and not body["adapters_unchanged"]
            assert {a["name"] for a in body["adapters"]} == {"a8", "a16", "late"}
            (state,) = cluster.states()
            assert state.adapters == {"a8", "a16", "late"}
        finally:
            client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    # a version that is not the server's now (garbage included) gets the whole list
    for since in (str(version), "x"):
        assert len(client.get(f"/stats?adapters_since={since}").get_json()["adapters"]) == 2
