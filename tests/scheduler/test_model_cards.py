"""The scheduler's `/v1/models` cards have the fields of a server's (`created`, `root`,
`parent`): a client that reads them works against either.

The server stand-in answers its `/v1/models` with the server's own card builder
(server.api.openai.response.models_response)."""

from __future__ import annotations

import time

import pytest

from toppings.scheduler.app import create_app
from toppings.server.api.openai.response import models_response

URL = "http://10.0.0.1:8100"
BASE = "tiny-llama"
ADAPTERS = [{"name": "sql", "rank": 16}, {"name": "chat", "rank": 64}]


def server_answers() -> dict[str, dict]:
    stats = {"model": BASE, "kernel": "mbgmv", "device": "cpu", "lora_mode": "cached",
             "running": [], "queue": [],
             "adapters": [dict(a, resident=True) for a in ADAPTERS],
             "free_kv_tokens": 1000, "max_total_tokens": 2048, "healthy": True}  # fmt: skip
    models = models_response(BASE, ADAPTERS, int(time.time()))
    return {URL + "/stats": stats, URL + "/v1/models": models}


@pytest.fixture
def client(tmp_path, scheduler_parts):
    with scheduler_parts(tmp_path, server_answers().__getitem__) as (_, cluster, router):
        client = create_app(router, cluster, {}).test_client()
        assert client.post("/admin/servers", json={"url": URL}).status_code == 201
        yield client


def test_cards_have_the_servers_fields(client):
    before = int(time.time())
    server_cards = {c["id"]: c for c in server_answers()[URL + "/v1/models"]["data"]}
    cards = {c["id"]: c for c in client.get("/v1/models").get_json()["data"]}
    assert set(cards) == set(server_cards)
    for model_id, card in cards.items():
        server_card = server_cards[model_id]
        assert set(card) == set(server_card), model_id
        for key in ("object", "owned_by", "root", "parent"):
            assert card[key] == server_card[key], (model_id, key)
        assert isinstance(card["created"], int) and card["created"] <= before + 1
    assert cards["sql"]["rank"] == 16 and cards[BASE]["parent"] is None
    assert client.get("/v1/models/chat").get_json() == cards["chat"]
