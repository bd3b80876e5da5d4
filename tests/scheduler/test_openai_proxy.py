"""The scheduler passes issue 17's fields through unchanged: the same body answers the same
through the scheduler as from the server (n, logprobs, echo, lists of prompts, penalties,
streamed too), and the scheduler has `GET /v1/models/{id}`, `/tokenize` and JSON 404/405."""

from __future__ import annotations

import json

import pytest

from tests.scheduler.test_error_contract import clients  # noqa: F401  (the fixture)

BODIES = [
    {"model": "a8", "prompt": ["The cat", "A dog"], "n": 2, "max_tokens": 3, "temperature": 0,
     "logprobs": 2},
    {"model": "a8", "prompt": [[5, 9, 30], [7, 7]], "max_tokens": 0, "echo": True, "logprobs": 1},
    {"model": "a8", "prompt": "ab", "max_tokens": 5, "temperature": 0, "presence_penalty": 1.0,
     "frequency_penalty": 0.5, "repetition_penalty": 1.3, "min_tokens": 2, "ignore_eos": True,
     "logit_bias": {"40": 3}},
]  # fmt: skip
VOLATILE = ("id", "created")


def _stable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in VOLATILE}


@pytest.mark.parametrize("body", BODIES)
def test_same_answer_through_the_scheduler(clients, body):  # noqa: F811
    scheduler, server = clients
    direct = server.post("/v1/completions", json=body)
    routed = scheduler.post("/v1/completions", json=body)
    assert direct.status_code == routed.status_code == 200
    assert _stable(routed.get_json()) == _stable(direct.get_json())


def test_streamed_choices_pass_through(clients):  # noqa: F811
    scheduler, server = clients
    body = {"model": "a8", "prompt": ["x", "y"], "n": 2, "max_tokens": 3, "temperature": 0,
            "logprobs": 1, "stream": True, "ignore_eos": True}  # fmt: skip

    def events(answer) -> list[dict]:
        frames = [f for f in answer.get_data(as_text=True).split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        return [_stable(json.loads(f[6:])) for f in frames[:-1]]

    direct = events(server.post("/v1/completions", json=body))
    routed = events(scheduler.post("/v1/completions", json=body))
    assert {c["index"] for e in routed for c in e["choices"]} == {0, 1, 2, 3}
    by_index = [
        sorted(json.dumps(c) for e in evs for c in e["choices"]) for evs in (direct, routed)
    ]
    assert by_index[0] == by_index[1]


def test_models_retrieve_tokenize_and_routing_errors(clients):  # noqa: F811
    scheduler, server = clients
    assert (
        scheduler.get("/v1/models/a8").get_json()["parent"]
        == server.get("/v1/models/a8").get_json()["parent"]
    )
    for client in (scheduler, server):
        missing = client.get("/v1/models/ghost")
        assert missing.status_code == 404 and missing.get_json()["error"]["type"] == "not_found"
    body = {"model": "a8", "prompt": "The cat"}
    assert (
        scheduler.post("/tokenize", json=body).get_json()
        == server.post("/tokenize", json=body).get_json()
    )
    for method, path in (("GET", "/v1/nope"), ("DELETE", "/v1/completions")):
        answers = [c.open(path, method=method) for c in (scheduler, server)]
        assert answers[0].status_code == answers[1].status_code in (404, 405)
        assert answers[0].get_json() == answers[1].get_json()


@pytest.mark.parametrize("stream", [False, True])
def test_the_ignored_fields_header_comes_through(clients, stream):  # noqa: F811
    scheduler, server = clients
    body = {"model": "a8", "prompt": "ab", "max_tokens": 2, "temperature": 0, "stream": stream,
            "user": "u-1", "metadata": {"k": "v"}}  # fmt: skip
    direct = server.post("/v1/completions", json=body)
    routed = scheduler.post("/v1/completions", json=body)
    assert direct.status_code == routed.status_code == 200
    header = "X-Toppings-Ignored-Fields"
    assert routed.headers[header] == direct.headers[header] == "metadata, user"
    plain = scheduler.post("/v1/completions", json={"model": "a8", "prompt": "ab", "max_tokens": 1})
    assert header not in plain.headers


def test_a_responses_body_is_routed_by_its_model(clients):  # noqa: F811
    """/v1/responses through the scheduler answers as the server does (ids aside), the ignored
    fields' header too; an unknown model is the same 404."""
    scheduler, server = clients
    body = {"model": "a8", "input": "The cat", "instructions": "Be brief.", "temperature": 0,
            "max_output_tokens": 4, "user": "u-1"}  # fmt: skip
    direct, routed = (
        server.post("/v1/responses", json=body),
        scheduler.post("/v1/responses", json=body),
    )
    assert direct.status_code == routed.status_code == 200
    assert routed.headers["X-Toppings-Ignored-Fields"] == "user"

    def stable(answer) -> dict:
        volatile = ("id", "created_at", "usage")  # the second finds the first's prefix cached
        reply = {k: v for k, v in answer.get_json().items() if k not in volatile}
        reply["output"] = [{k: v for k, v in item.items() if k != "id"} for item in reply["output"]]
        return reply

    assert stable(routed) == stable(direct)
    assert routed.get_json()["usage"]["input_tokens"] == direct.get_json()["usage"]["input_tokens"]
    ghost = {**body, "model": "ghost"}
    answers = [c.post("/v1/responses", json=ghost) for c in (scheduler, server)]
    assert answers[0].status_code == answers[1].status_code == 404
