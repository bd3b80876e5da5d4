"""Tool `parameters` with `$defs` / `$ref` / `anyOf` (what pydantic emits) compile as they do
under `response_format`, for every `tool_choice` (issue 67: a "required" or named choice was a
400 "Pointer '/$defs/City' does not exist"); a call's arguments validate against the
parameters under the `jsonschema` package."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.helpers import running_engine
from toppings.server.api.app import create_app

pytestmark = pytest.mark.slow  # llguidance needs a real tokenizer: SmolLM2's


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, so calls end
    name: str = Field(max_length=20)
    population: int | None = Field(default=None, ge=0, le=10**8)


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: City
    unit: str = Field(max_length=12)


PARAMETERS = Weather.model_json_schema()
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(smollm2_dir):
    with running_engine(smollm2_dir, {}, max_total_tokens=8192) as eng:
        yield create_app(eng).test_client()


def _chat(client, **fields) -> dict:
    body = {"messages": ASK, "max_tokens": 80, "temperature": 0, **fields}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.get_data()[:400]
    return answer.get_json()["choices"][0]


def test_the_parameters_compile_as_a_response_format(client):
    assert "$defs" in PARAMETERS and "$ref" in json.dumps(PARAMETERS)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMETERS}}
    choice = _chat(client, response_format=fmt)
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PARAMETERS)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_constrained_call_follows_parameters_with_refs(client, tool_choice):
    choice = _chat(client, tools=TOOLS, tool_choice=tool_choice)
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    if tool_choice == NAMED:
        assert call["function"]["name"] == "get_weather"
    schema = next(t["function"]["parameters"] for t in TOOLS
                  if t["function"]["name"] == call["function"]["name"])  # fmt: skip
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_auto_is_served_with_the_same_tools(client):
    choice = _chat(client, tools=TOOLS, tool_choice="auto")
    for call in choice["message"].get("tool_calls") or ():
        assert call["function"]["name"] in ("get_weather", "get_time")
