"""An adapter whose LoRA product cannot be finite: refused at load with a 400 naming the module;
one that turns non-finite at run time fails its own requests with a clear 500 (an error event
when streaming) and the server keeps serving."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.api.app import ApiOptions, create_app

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite_api")
    make_random_adapter(root / "good", tiny_model_dir, rank=8, seed=1)
    make_random_adapter(root / "bad", tiny_model_dir, rank=8, seed=2)
    alpha = make_random_adapter(root / "huge_alpha", tiny_model_dir, rank=8, seed=3)
    config = json.loads((alpha / "adapter_config.json").read_text())
    (alpha / "adapter_config.json").write_text(json.dumps(dict(config, lora_alpha=1e308)))
    huge = make_random_adapter(root / "huge_weights", tiny_model_dir, rank=8, seed=4)
    tensors = load_file(huge / WEIGHTS)
    save_file({k: t.fill_(3e38) for k, t in tensors.items()}, huge / WEIGHTS)  # finite float32
    return root


@pytest.fixture(scope="module")
def engine(tiny_engine, root):
    loras = {name: str(root / name) for name in ("good", "bad")}
    with tiny_engine(loras, max_total_tokens=2048, lora_mode="cached") as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine, root):
    return create_app(engine, ApiOptions(lora_roots=(str(root),))).test_client()


def completion(client, model: str, stream: bool = False):
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "stream": stream}
    return client.post("/v1/completions", json=body)


@pytest.mark.parametrize("name", ["huge_alpha", "huge_weights"])
def test_an_overflowing_adapter_is_refused_at_load(client, engine, root, name):
    load = {"lora_name": name, "lora_path": str(root / name)}
    response = client.post("/v1/load_lora_adapter", json=load)
    assert response.status_code == 400, response.get_data(as_text=True)
    message = response.get_json()["error"]["message"]
    assert "model.layers." in message or "scaling" in message, message
    assert "overflows float32" in message, message
    assert name not in [a["name"] for a in engine.adapters()]
    assert completion(client, "good").status_code == 200


def test_non_finite_logits_fail_the_request_and_the_server_keeps_serving(client, engine):
    pool = engine.lora.pool
    # cached mode: on the device since its registration
    resident = pool.resident[engine.resolve_adapter("bad").id]
    for module in resident.targets:
        pool.lora_a[module][:, resident.offset : resident.offset + resident.rank].fill_(3e38)
    failed = completion(client, "bad")
    assert failed.status_code == 500
    error = failed.get_json()["error"]
    assert error["type"] == "server_error"
    assert "adapter 'bad' produced non-finite logits" in error["message"]
    streamed = completion(client, "bad", stream=True)
    frames = [f[6:] for f in streamed.get_data(as_text=True).split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    assert "non-finite logits" in json.loads(frames[-2])["error"]["message"]
    assert engine.is_healthy()
    for model in ("good", engine.model_name):
        ok = completion(client, model)
        assert ok.status_code == 200 and ok.get_json()["choices"][0]["finish_reason"]
