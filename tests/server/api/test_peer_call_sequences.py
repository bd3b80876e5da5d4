"""The control planes' calls, replayed as their code makes them, against a real server process
(a tiny random Llama, `--api-key`, KV events on):

- AIBrix's adapter controller (vllm-project/aibrix, pkg/controller/modeladapter/lora_client.go,
  the direct engine path): `GET /v1/models` with `Authorization: Bearer KEY`, 200 only, reading
  `data[].id` to see whether the adapter is there; if not, `POST /v1/load_lora_adapter` with
  `Content-Type: application/json` and `{"lora_name", "lora_path"}`, success being 200 or 201;
  `POST /v1/unload_lora_adapter {"lora_name"}` (200 or 201, else a warning);
- the inference gateway's endpoint picker scraping `/metrics` for its vLLM names
  (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:lora_requests_info` with
  `running_lora_adapters` / `waiting_lora_adapters` / `max_lora`, the newest sample by value,
  adapters comma-separated) and the prefix-cache scorer's `vllm:cache_config_info{block_size}`;
- llm-d-router's lora-load-state scorer (llm-d/llm-d-router#2792) reading
  `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}`;
- a KV-aware router reading the events' endpoint and block size from `/stats`, and the dropped
  and published counts on `/metrics`.

Our `/metrics` asks for the key when the server has one (vLLM guards only `/v1/*`): a scraper
of a keyed server sends it, as here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_healthy

KEY = "peer-key"
JSON = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, free_port):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("peers")
    adapter = make_random_adapter(root / "sql-lora", tiny_model_dir, rank=8, seed=3)
    port, events = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    cmd = [sys.executable, "-m", "toppings.server.cli", "--model", str(tiny_model_dir),
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--api-key", KEY,
           "--kv-events-endpoint", f"tcp://*:{events}",
           "--allowed-lora-root", str(root)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_healthy(url, proc, log, 90.0)
        yield {"url": url, "adapter": str(adapter), "events": events}
    finally:
        proc.kill()
        proc.wait(timeout=30)


def aibrix_models(url: str) -> dict[str, bool]:
    """lora_client.go getModels: 200 only, then data[].id."""
    answer = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200, answer.text
    return {item["id"]: True for item in answer.json()["data"]}


def aibrix_load(url: str, name: str, path: str) -> tuple[bool, bool]:
    """lora_client.go LoadAdapter: (loaded, exists)."""
    if aibrix_models(url).get(name):
        return False, True
    body = json.dumps({"lora_name": name, "lora_path": path})  # Go marshals a map sorted
    answer = requests.post(url + "/v1/load_lora_adapter", data=body, headers=JSON)
    assert answer.status_code in (200, 201), answer.text
    return True, False


def aibrix_unload(url: str, name: str) -> int:
    answer = requests.post(url + "/v1/unload_lora_adapter", data=json.dumps({"lora_name": name}),
                           headers=JSON)  # fmt: skip
    return answer.status_code


def scrape(url: str) -> dict:
    text = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_aibrix_adapter_controller_sequence(server):
    url, name = server["url"], "sql-lora"
    unauthorized = requests.get(url + "/v1/models")  # a ModelAdapter without its api-key
    assert unauthorized.status_code == 401
    assert aibrix_load(url, name, server["adapter"]) == (True, False)
    assert aibrix_models(url).get(name)
    assert aibrix_load(url, name, server["adapter"]) == (False, True)  # the next reconcile
    answer = requests.post(
        url + "/v1/completions",
        headers=JSON,
        data=json.dumps({"model": name, "prompt": "a b c", "max_tokens": 2}),
    )
    assert answer.status_code == 200, answer.text  # fmt: skip
    assert aibrix_unload(url, name) in (200, 201)
    assert not aibrix_models(url).get(name)
    assert aibrix_load(url, name, server["adapter"]) == (True, False)  # loaded again


def test_gateway_and_llm_d_read_their_series(server):
    url, name = server["url"], "sql-lora"
    aibrix_load(url, name, server["adapter"])
    body = {"model": name, "prompt": list(range(5, 60)), "max_tokens": 2}
    assert requests.post(url + "/v1/completions", headers=JSON, json=body).status_code == 200
    fams = scrape(url)
    for gauge in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                  "vllm:kv_cache_usage_perc"):  # fmt: skip
        (sample,) = fams[gauge].samples
        assert sample.value >= 0
    info = max(fams["vllm:lora_requests_info"].samples, key=lambda s: s.value)  # the newest
    running = [a.strip() for a in info.labels["running_lora_adapters"].split(",") if a]
    assert name in running and int(info.labels["max_lora"]) >= 1
    assert "waiting_lora_adapters" in info.labels
    loaded = {s.labels["adapter_name"]: s.labels for s in fams["vllm:lora_adapter_loaded"].samples}
    assert loaded[name]["level"] == "gpu" and loaded[name]["rank"] == "8"
    assert loaded[name]["pinned"] in ("true", "false")
    stats = requests.get(url + "/stats", headers=JSON).json()
    (config,) = fams["vllm:cache_config_info"].samples
    assert int(config.labels["block_size"]) == stats["kv_events"]["block_size"]
    assert int(config.labels["num_gpu_blocks"]) == stats["memory"]["blocks"]["total"]


def test_a_kv_router_finds_the_events_and_their_counts(server):
    url = server["url"]
    stats = requests.get(url + "/stats", headers=JSON).json()["kv_events"]
    assert stats["endpoint"] == f"tcp://*:{server['events']}"
    assert stats["replay_endpoint"] is None and stats["topic"] == "kv-events"
    assert stats["encoding"] == "array" and stats["stream"]
    fams = scrape(url)
    published = fams["toppings:kv_events_batches"].samples[0].value
    assert published >= 1  # AllBlocksCleared at start, at least
    assert fams["toppings:kv_events_dropped"].samples[0].value == 0
    assert fams["toppings:kv_events_resyncs_asked"].samples[0].value == 0
