"""`--admin-api-key` (issue 48): with it, adapter load and unload and an adapter's files want
the admin key and the client key no longer opens them (a tenant cannot unload another tenant's
adapter, nor download its weights); the client key keeps generation and reads; the admin key
opens everything (the scheduler's --server-api-key, a peer's fetch)."""

from __future__ import annotations

import pytest

from toppings.server.api.app import ApiOptions, create_app
from toppings.server.cli_args import build_parser, parse_configs

CLIENT, ADMIN = "client-key", "admin-key"


@pytest.fixture(scope="module")
def setup(tiny_engine, tiny_model_dir, tmp_path_factory):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("admin_roots")
    lora = make_random_adapter(root / "a", tiny_model_dir, rank=4, seed=0)
    options = ApiOptions(api_key=CLIENT, admin_api_key=ADMIN, lora_roots=(str(root),))
    with tiny_engine({"a": str(lora)}, max_total_tokens=1024) as engine:
        yield create_app(engine, options).test_client(), str(lora)


def _as(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_the_client_key_cannot_load_or_unload(setup):
    client, path = setup
    for key in (CLIENT, None, "wrong"):
        load = client.post("/v1/load_lora_adapter", headers=_as(key),
                           json={"lora_name": "b", "lora_path": path})  # fmt: skip
        unload = client.post("/v1/unload_lora_adapter", headers=_as(key), json={"lora_name": "a"})
        for answer in (load, unload):
            assert answer.status_code == 401
            error = answer.get_json()["error"]
            assert error["type"] == "authentication_error" and "admin key" in error["message"]
    models = client.get("/v1/models", headers=_as(CLIENT)).get_json()["data"]
    assert {"a"} <= {m["id"] for m in models} and "b" not in {m["id"] for m in models}


def test_the_client_key_keeps_generation_and_reads(setup):
    client, _ = setup
    body = {"model": "a", "prompt": "hi", "max_tokens": 2}
    assert client.post("/v1/completions", headers=_as(CLIENT), json=body).status_code == 200
    for path in ("/v1/models", "/stats", "/metrics"):
        assert client.get(path, headers=_as(CLIENT)).status_code == 200, path
    assert client.post("/v1/completions", json=body).status_code == 401
    assert client.get("/health").status_code == 200


def test_an_adapters_files_want_the_admin_key(setup):
    """A tenant's weights: the client key (every tenant's) does not read them; a peer fetching
    them sends the admin key."""
    client, _ = setup
    for path in ("/v1/adapters/a/files", "/v1/adapters/a/files/adapter_model.safetensors"):
        for key in (CLIENT, None):
            answer = client.get(path, headers=_as(key))
            assert (
                answer.status_code == 401 and "admin key" in answer.get_json()["error"]["message"]
            )
        assert client.get(path, headers=_as(ADMIN)).status_code == 200, path


def test_the_admin_key_loads_unloads_and_opens_the_rest(setup):
    client, path = setup
    body = {"lora_name": "b", "lora_path": path}
    assert client.post("/v1/load_lora_adapter", headers=_as(ADMIN), json=body).status_code == 200
    gen = {"model": "b", "prompt": "hi", "max_tokens": 2}
    assert client.post("/v1/completions", headers=_as(ADMIN), json=gen).status_code == 200
    unload = client.post("/v1/unload_lora_adapter", headers=_as(ADMIN), json={"lora_name": "b"})
    assert unload.status_code == 200


def test_the_flag_and_its_variable(monkeypatch):
    def options(*flags: str) -> ApiOptions:
        return parse_configs(build_parser().parse_args(["--model", "m", *flags]))[2]

    assert options("--admin-api-key", "k").admin_api_key == "k"
    monkeypatch.setenv("TOPPINGS_SERVER_ADMIN_API_KEY", "from-env")
    assert options().admin_api_key == "from-env"
    with pytest.raises(ValueError, match="admin_api_key must not be empty"):
        options("--admin-api-key", "")
