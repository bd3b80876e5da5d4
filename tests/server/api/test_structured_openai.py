"""Structured output through HTTP with the `openai` client on SmolLM2 (base and an adapter):
`chat.completions.parse`, streaming with n, logprobs and stop strings, and the 400s."""

from __future__ import annotations

import json

import pytest
import requests
from pydantic import BaseModel, Field

from tests.helpers import running_engine
from toppings.server.api.app import create_app

pytestmark = pytest.mark.slow
ADAPTER = "extract"


class City(BaseModel):
    name: str
    country: str
    # Bounded: left unbounded, greedy SmolLM2 writes digits until max_tokens ("length").
    population_millions: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_dir):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("structured_http")
    loras = {ADAPTER: str(make_random_adapter(root / ADAPTER, smollm2_dir, rank=8, seed=5))}
    with running_engine(smollm2_dir, loras, max_total_tokens=8192) as eng:
        yield eng


@pytest.fixture(scope="module")
def base_url(engine, serve_app):
    with serve_app(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url, openai_client):
    return openai_client(base_url, 300)


@pytest.mark.parametrize("adapter", [None, ADAPTER])
def test_parse_with_pydantic_model(client, engine, adapter):
    completion = client.chat.completions.parse(
        model=adapter or engine.model_name,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_on_completions(client, engine):
    out = client.completions.create(
        model=engine.model_name,
        prompt="A JSON object about a cat:",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_stream_n_logprobs_with_choice(client, engine):
    choices = ["sunny and warm", "cold and rainy", "windy"]
    kwargs = dict(
        model=ADAPTER,
        messages=[{"role": "user", "content": "What is the weather like?"}],
        max_tokens=20,
        temperature=1.0,
        seed=7,
        n=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"guided_choice": choices},
    )
    whole = client.chat.completions.create(**kwargs)
    texts, tokens, finish = ["", "", ""], [0, 0, 0], [None] * 3
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            tokens[c.index] += len(c.logprobs.content) if c.logprobs else 0
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert all(t in choices for t in texts) and finish == ["stop"] * 3
    assert tokens == [len(c.logprobs.content) for c in whole.choices]
    assert all(len(lp.top_logprobs) == 2 for c in whole.choices for lp in c.logprobs.content)


def test_stop_string_inside_a_constraint(client, engine):
    out = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=20,
        temperature=0,
        stop=["apple"],
        extra_body={"guided_choice": ["red apple pie"]},
    )
    assert out.choices[0].message.content == "red "
    assert out.choices[0].finish_reason == "stop"


def test_length_when_max_tokens_ends_first(client, engine):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 40}
    out = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": "Numbers please."}],
        max_tokens=6,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
         "strin"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"guided_regex": "([a-z]"}, "regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "grammar"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tools": [{"type": "funktion", "function": {"name": "f"}}]}, "tools"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_it(base_url, engine, fields, named):
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}]}
    reply = requests.post(f"{base_url}/v1/chat/completions", json=dict(body, **fields), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"]
