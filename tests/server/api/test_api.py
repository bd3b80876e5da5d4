"""The HTTP layer through Flask's test client, on a tiny random Llama with two random adapters."""

from __future__ import annotations

import contextlib
import json
import queue
from pathlib import Path

import pytest

from tests.helpers import running_engine, spy_on_submissions
from toppings.server.api.app import create_app
from toppings.server.engine.engine import Engine
from toppings.server.requests.request import GenerationRequest, SamplingParams

ADAPTERS = {"a8": (8, ("q_proj", "v_proj")), "a16": (16, ("q_proj", "o_proj", "down_proj"))}


def start_engine(root: Path, base_dir: Path) -> contextlib.AbstractContextManager[Engine]:
    """A started engine on the tiny Llama with the two ADAPTERS, made under `root`; it shuts
    down when the `with` block ends."""
    from toppings.scripts.make_adapters import make_random_adapter

    loras = {
        name: str(make_random_adapter(root / name, base_dir, rank=r, target_modules=t, seed=i))
        for i, (name, (r, t)) in enumerate(ADAPTERS.items())
    }
    return running_engine(base_dir, loras, max_total_tokens=4096)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model_dir):
    with start_engine(tmp_path_factory.mktemp("api_adapters"), tiny_model_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    return create_app(engine).test_client()


def direct(engine, ids: list[int], max_new: int, adapter: str | None = None) -> list[int]:
    """Greedy tokens straight from the engine, to compare the HTTP answers against."""
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return (
        engine.submit(GenerationRequest(ids, params, engine.resolve_adapter(adapter)))
        .result(60)
        .new_token_ids
    )


def sse_events(body: bytes) -> list[dict]:
    frames = [f for f in body.decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]" and all(f.startswith("data: ") for f in frames)
    return [json.loads(f[6:]) for f in frames[:-1]]


def test_health_models_stats(client, engine):
    assert client.get("/health").get_json() == {"status": "ok"}
    models = client.get("/v1/models").get_json()
    assert [(m["id"], m["parent"]) for m in models["data"]] == [
        (engine.model_name, None),
        ("a8", engine.model_name),
        ("a16", engine.model_name),
    ]
    stats = client.get("/stats").get_json()
    assert stats["running"] == [] and stats["free_kv_tokens"] == 4096


@pytest.mark.parametrize("adapter", [None, "a8", "a16"])
def test_generate_matches_engine(client, engine, adapter):
    ids = [5, 17, 42, 9, 77]
    body = {
        "adapter": adapter,
        "input_ids": ids,
        "max_new_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    got = client.post("/generate", json=body).get_json()
    assert got["token_ids"] == direct(engine, ids, 6, adapter)
    assert got["prompt_tokens"] == 5 and got["finish_reason"] == "length"
    assert got["text"] == engine.tokenizer.decode(got["token_ids"])
    assert got["ttft_s"] <= got["e2e_s"]
    stream = sse_events(client.post("/generate", json=dict(body, stream=True)).data)
    assert [t for e in stream for t in e["token_ids"]] == got["token_ids"]
    assert "".join(e["text"] for e in stream) == got["text"]
    assert stream[-1]["finish_reason"] == "length" and stream[-1]["output_tokens"] == 6


def test_completions(client, engine):
    body = {
        "model": "a8",
        "prompt": "hello world",
        "max_tokens": 5,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    got = client.post("/v1/completions", json=body).get_json()
    ids = engine.tokenizer.encode("hello world")
    assert got["object"] == "text_completion" and got["model"] == "a8"
    assert got["choices"][0]["text"] == engine.tokenizer.decode(direct(engine, ids, 5, "a8"))
    assert got["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 5,
        "total_tokens": len(ids) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    chunks = sse_events(client.post("/v1/completions", json=dict(body, stream=True)).data)
    assert "".join(c["choices"][0]["text"] for c in chunks) == got["choices"][0]["text"]
    # The default length is 16 tokens; token-id prompts and the base model's name work too.
    got = client.post(
        "/v1/completions", json={"model": engine.model_name, "prompt": ids, "ignore_eos": True}
    ).get_json()
    assert got["usage"]["completion_tokens"] == 16 and got["usage"]["prompt_tokens"] == len(ids)


def test_chat_uses_the_template(client, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = {
        "model": "a16",
        "messages": messages,
        "max_completion_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    got = client.post("/v1/chat/completions", json=body).get_json()
    text = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert got["usage"]["prompt_tokens"] == len(ids)
    expected = engine.tokenizer.decode(direct(engine, ids, 4, "a16"))
    assert got["choices"][0]["message"] == {"role": "assistant", "content": expected}
    chunks = sse_events(client.post("/v1/chat/completions", json=dict(body, stream=True)).data)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected


def test_stop_string_and_seeded_sampling(client):
    body = {
        "input_ids": [3, 4, 5],
        "max_new_tokens": 12,
        "temperature": 1.0,
        "seed": 11,
        "ignore_eos": True,
    }
    first = client.post("/generate", json=body).get_json()
    assert client.post("/generate", json=body).get_json()["token_ids"] == first["token_ids"]
    half = len(first["text"]) // 2
    stop = first["text"][half : half + 2]
    assert len(stop) == 2, first["text"]
    cut = client.post("/generate", json=dict(body, stop=[stop])).get_json()
    assert cut["finish_reason"] == "stop" and stop not in cut["text"]
    assert first["text"].startswith(cut["text"]) and len(cut["text"]) <= half


def _too_long(engine) -> dict:
    return {"input_ids": [3] * engine.max_model_len, "max_new_tokens": 1}


BAD_REQUESTS = [
    # (method, path, body: dict | bytes | callable(engine) -> dict, status)
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/completions", b"[1, 2]", 400),
    ("POST", "/v1/completions", b"", 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "n": 99}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("POST", "/v1/completions", {"prompt": [1, 10**9]}, 400),
    ("POST", "/v1/completions", {"prompt": []}, 400),
    ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "ghost", "messages": [{"role": "user", "content": "x"}]},
        404,
    ),  # noqa: E501
    ("POST", "/generate", {"adapter": "ghost", "prompt": "x"}, 404),
    ("POST", "/generate", _too_long, 400),
    ("GET", "/no/such/route", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/models", None, 405),
]


@pytest.mark.parametrize("method, path, body, status", BAD_REQUESTS)
def test_bad_requests_get_json_errors(client, engine, method, path, body, status):
    if callable(body):
        body = body(engine)
    kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
    response = client.open(path, method=method, **kwargs)
    assert response.status_code == status
    error = response.get_json()["error"]
    assert error["code"] == status and isinstance(error["message"], str) and error["type"]
    ok = client.post("/generate", json={"input_ids": [1, 2], "max_new_tokens": 2})
    assert ok.status_code == 200 and len(ok.get_json()["token_ids"]) <= 2


def test_a_refused_request_is_logged_in_one_line_and_a_429_is_not(client, engine, caplog):
    import logging

    from toppings.server.requests.errors import QUIET_REFUSALS

    with caplog.at_level(logging.INFO):
        response = client.post("/v1/completions", json={"model": "ghost", "prompt": "x"})
    assert response.status_code == 404
    (line,) = [r for r in caplog.records if "/v1/completions" in r.getMessage()]
    rid = response.headers["X-Request-Id"]  # made here: the client sent none
    assert line.levelno == logging.INFO
    assert f"POST /v1/completions [{rid}]: 404" in line.getMessage()
    assert "ghost" in line.getMessage()
    assert 429 in QUIET_REFUSALS  # a flood of 429s is counted in /metrics, not logged


def test_unexpected_exception_is_a_json_500(client, engine, monkeypatch):
    def broken():
        raise KeyError("boom")

    monkeypatch.setattr(engine, "stats", broken)
    response = client.get("/stats")
    assert response.status_code == 500 and response.get_json()["error"]["code"] == 500
    assert client.get("/health").status_code == 200


def test_closing_a_stream_aborts_the_request(client, engine, monkeypatch):
    finals = queue.Queue()  # what the engine puts (the handle's own queue is the group's)

    def watched(req, handle):
        put = handle.put
        handle.put = lambda out: (put(out), out.finish_reason and finals.put(out))

    spy_on_submissions(engine, monkeypatch, watched)
    body = {
        "input_ids": [1, 2, 3],
        "max_new_tokens": engine.max_model_len - 3,
        "stream": True,
        "ignore_eos": True,
    }
    response = client.post("/generate", json=body, buffered=False)
    first = next(iter(response.response))
    assert first.startswith(b"data: {")
    response.close()  # what waitress does when the client hangs up
    final = finals.get(timeout=60)
    assert final.finish_reason == "abort"
    assert final.output_tokens < engine.max_model_len - 3
    stats = engine.stats().to_json()
    assert stats["running"] == [] and stats["queue"] == []
