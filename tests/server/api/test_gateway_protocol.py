"""The inference gateway's model-server protocol on `/metrics` (server.api.protocol_metrics),
checked against `/stats` of the same instant, and the adapter calls its LoRA sidecar makes.

The engine's thread is not started: the test steps it, so a busy state (running and waiting
requests of two adapters) holds still while `/metrics` and `/stats` are read."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from toppings.server.api.app import ApiOptions, create_app
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

MAX_BATCH = 2
PROMPT = list(range(5, 45))  # 40 tokens: two whole KV blocks of 16 can be cached


@pytest.fixture(scope="module")
def adapter_root(tiny_model_dir, tmp_path_factory):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("gateway")
    for seed, name in enumerate(("a", "b", "sidecar")):
        make_random_adapter(root / name, tiny_model_dir, rank=8, seed=seed)
    return root


@pytest.fixture
def engine(tiny_model_dir, adapter_root):
    config = EngineConfig(dtype="float32", max_total_tokens=2048, max_batch_size=MAX_BATCH,
                          lora_mode="cached")  # fmt: skip
    eng = Engine(config, load_checkpoint(str(tiny_model_dir)))
    for name in ("a", "b"):
        eng.add_adapter(name, str(adapter_root / name))
    yield eng
    eng.shutdown()


def drive(engine, until, timeout_s: float = 60.0) -> None:
    """Step the engine until `until()` holds."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        if engine.step() is None:
            time.sleep(0.002)  # an adapter load in flight


def submit(engine, adapter: str | None, max_new: int):
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return engine.submit(GenerationRequest(list(PROMPT), params, engine.resolve_adapter(adapter)))


def families(client) -> dict:
    text = client.get("/metrics").get_data(as_text=True)
    return {f.name: f for f in text_string_to_metric_families(text)}


def only_sample(family) -> tuple[dict, float]:
    (sample,) = family.samples
    return sample.labels, sample.value


def adapters_of(requests: list[dict]) -> str:
    return ",".join(sorted({r["adapter"] for r in requests if r["adapter"] is not None}))


def test_protocol_metrics_of_a_busy_server_match_stats(engine):
    client = create_app(engine).test_client()
    first = submit(engine, "a", 2)  # its prompt's blocks are cached for the busy requests
    outs = []
    drive(engine, lambda: outs.extend(first.poll()) or any(o.finish_reason for o in outs))
    for adapter in ("a", "b", "a", "b", None):
        submit(engine, adapter, 200)
    drive(engine, lambda: engine.stats().running)
    before = time.time()
    fams = families(client)
    after = time.time()
    stats = client.get("/stats").get_json()
    assert len(stats["running"]) == MAX_BATCH and len(stats["queue"]) == 3
    # running: resident adapters with those of the running requests ("loaded and ready")
    ready = set(stats["resident_adapters"])
    ready |= {r["adapter"] for r in stats["running"] if r["adapter"]}
    running, waiting = ",".join(sorted(ready)), adapters_of(stats["queue"])
    assert running and waiting  # adapters both running and waiting

    model = {"model_name": stats["model"]}
    free_fraction = stats["free_kv_tokens"] / stats["max_total_tokens"]
    gauges = {
        "vllm:num_requests_waiting": len(stats["queue"]),
        "vllm:num_requests_running": len(stats["running"]),
        "vllm:kv_cache_usage_perc": pytest.approx(1.0 - free_fraction),
        "vllm:gpu_cache_usage_perc": pytest.approx(1.0 - free_fraction),
    }
    for name, value in gauges.items():
        assert fams[name].type == "gauge", name
        assert only_sample(fams[name]) == (model, value), name
    assert 0.0 < only_sample(fams["vllm:kv_cache_usage_perc"])[1] < 1.0

    counters = {"vllm:prefix_cache_queries": stats["memory"]["prompt_tokens"],
                "vllm:prefix_cache_hits": stats["memory"]["prefix_hit_tokens"]}  # fmt: skip
    for name, value in counters.items():
        assert fams[name].type == "counter", name
        (sample,) = fams[name].samples
        assert sample.name == name + "_total" and sample.labels == model
        assert sample.value == value, name
    assert counters["vllm:prefix_cache_hits"] > 0  # the busy requests reused the first's prompt

    info = fams["vllm:lora_requests_info"]
    assert info.type == "gauge"
    labels, stamp = only_sample(info)
    assert labels == {"running_lora_adapters": running, "waiting_lora_adapters": waiting,
                      "max_lora": str(MAX_BATCH)}  # fmt: skip
    assert before <= stamp <= after  # the sample's time, as vLLM sets it
    assert "toppings:num_requests_running" in fams  # our own series stay


def test_idle_server_reports_its_resident_adapters_and_no_waiting(engine):
    client = create_app(engine).test_client()
    resident = client.get("/stats").get_json()["resident_adapters"]
    fams = families(client)
    labels, _ = only_sample(fams["vllm:lora_requests_info"])
    assert labels["running_lora_adapters"] == ",".join(sorted(resident))
    assert labels["waiting_lora_adapters"] == ""
    assert only_sample(fams["vllm:num_requests_running"])[1] == 0
    assert only_sample(fams["vllm:kv_cache_usage_perc"])[1] == 0.0


def test_lora_sidecar_calls(engine, adapter_root):
    """The gateway's adapter syncer loads by name and path, lists with /v1/models and unloads
    by name, with vLLM's bodies."""
    client = create_app(engine, ApiOptions(lora_roots=(str(adapter_root),))).test_client()
    body = {"lora_name": "sidecar", "lora_path": str(adapter_root / "sidecar")}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
    listed = {m["id"]: m for m in client.get("/v1/models").get_json()["data"]}
    assert listed["sidecar"]["parent"] == engine.model_name
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sidecar"}).status_code == 200
    assert "sidecar" not in {m["id"] for m in client.get("/v1/models").get_json()["data"]}
