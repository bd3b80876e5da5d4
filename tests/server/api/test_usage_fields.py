"""OpenAI usage fields other tools read: `stream_options.continuous_usage_stats` (usage on every
chunk, vLLM's form) and `usage.prompt_tokens_details.cached_tokens` from the prefix cache."""

from __future__ import annotations

import json

import pytest

from toppings.server.api.app import create_app

BLOCK = 16  # the default KV block: the prefix cache matches whole blocks


@pytest.fixture(scope="module")
def engine(tiny_engine):
    with tiny_engine(max_total_tokens=2048) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    return create_app(engine).test_client()


def events(response) -> list[dict]:
    frames = response.get_data(as_text=True).split("\n\n")
    assert frames[-2] == "data: [DONE]"
    return [json.loads(f[6:]) for f in frames if f.startswith("data: {")]


def test_continuous_usage_on_every_chunk(client):
    prompt = [11, 12, 13, 14, 15]
    body = {"prompt": prompt, "max_tokens": 6, "n": 2, "temperature": 0, "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = events(client.post("/v1/completions", json=body))
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    seen = {0: 0, 1: 0}
    for chunk in deltas:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == len(prompt)
        # Its own choice's tokens so far: at least one more than before (a text delta).
        assert usage["completion_tokens"] > seen[choice["index"]]
        seen[choice["index"]] = usage["completion_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert seen == {0: 6, 1: 6}


def test_continuous_usage_on_chat_role_chunks(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = events(client.post("/v1/chat/completions", json=body))
    role = chunks[0]
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["usage"]["completion_tokens"] == 0 and role["usage"]["prompt_tokens"] > 0
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[-2]["usage"]["completion_tokens"] == 3


def test_include_usage_alone_keeps_usage_null_until_the_end(client):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    *deltas, last = events(client.post("/v1/completions", json=body))
    assert all(c["usage"] is None for c in deltas)
    assert last["usage"]["completion_tokens"] == 4


def test_continuous_usage_stats_must_be_a_boolean(client):
    body = {"prompt": [5], "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert "continuous_usage_stats" in response.get_json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_of_a_repeated_prefix(client, stream):
    # A prompt of its own per case (the first request finds nothing cached): 3 whole blocks.
    prompt = [100 + int(stream)] + list(range(20, 20 + 3 * BLOCK))
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}

    def usage() -> dict:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200
        return events(response)[-1]["usage"] if stream else response.get_json()["usage"]

    first = usage()
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = usage()
    # Every whole block but the one holding the last prompt token (recomputed for its logits).
    assert second["prompt_tokens_details"] == {"cached_tokens": 3 * BLOCK}
    assert second["prompt_tokens"] == len(prompt)


def test_cached_tokens_count_each_prompt_once(client):
    prompt = list(range(60, 60 + 2 * BLOCK + 1))
    warm = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert warm.status_code == 200
    body = {"prompt": [prompt, prompt[:5]], "max_tokens": 1, "n": 2}
    usage = client.post("/v1/completions", json=body).get_json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2 * BLOCK}
