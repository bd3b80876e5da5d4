"""Tool calls on a chat template that does not render `tools` (issue 48): SmolLM2's own, the
default model's. The generic format describes the tools in the system message and reads the
call as JSON; every `tool_choice` works through the `openai` client, streamed and not, and the
response says the fallback was used in `X-Toppings-Tool-Format: generic`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field

from tests.helpers import running_engine
from tests.server.api.test_tools_openai import TIME, TOOLS, WEATHER
from toppings.server.api.app import create_app
from toppings.server.api.openai.tools import (
    ToolChoice,
    Tools,
    generic_tool_messages,
    template_renders_tools,
)

pytestmark = pytest.mark.slow
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    with running_engine(smollm2_dir, {}, max_total_tokens=8192) as eng:
        assert not template_renders_tools(eng.tokenizer)  # SmolLM2's template, as shipped
        yield eng


@pytest.fixture(scope="module")
def base_url(engine, serve_app):
    with serve_app(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url, openai_client):
    return openai_client(base_url, 300)


def _create(client, engine, **kwargs):
    """The parsed completion and the response headers."""
    body = {"model": engine.model_name, "messages": ASK, "tools": TOOLS, "max_tokens": 60,
            "temperature": 0, **kwargs}  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(**body)
    return raw.parse(), raw.headers


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_required_and_named_calls(client, engine, choice):
    out, headers = _create(client, engine, tool_choice=choice)
    assert headers["x-toppings-tool-format"] == "generic"
    reply = out.choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    (call,) = reply.message.tool_calls
    if choice == NAMED:
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


OPEN_TOOLS = [  # parameters as clients write them: nothing said of other keys
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
    }}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "maximum": 1000},
                       "b": {"type": "integer", "maximum": 1000}},
    }}},
]  # fmt: skip


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_call_takes_only_the_keys_its_parameters_list(client, engine, choice):
    """Before objects were closed (as vLLM's xgrammar reads such a schema), SmolLM2 forced to
    `add` wrote `"c": 100, "d": 100, ...` until max_tokens, and under "required" copied the
    schema's own keys into get_weather's arguments (`"properties": {"maxLength": 30, ...}`)."""
    out, _ = _create(client, engine, tools=OPEN_TOOLS, tool_choice=choice)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    tool = next(t["function"] for t in OPEN_TOOLS if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    assert set(arguments) <= set(tool["parameters"]["properties"])
    jsonschema.validate(arguments, tool["parameters"])


def test_tokenize_counts_the_tools_as_a_chat_prompt_does(base_url, client, engine):
    """/tokenize with `tools` gives the count a chat request with them reports as its prompt
    (the tools in the generic format's system message), not the messages' alone."""
    body = {"model": engine.model_name, "messages": ASK, "tools": OPEN_TOOLS}
    counted = requests.post(f"{base_url}/tokenize", json=body, timeout=60).json()
    plain = requests.post(f"{base_url}/tokenize", json={"messages": ASK}, timeout=60).json()
    out, _ = _create(client, engine, tools=OPEN_TOOLS, max_tokens=1)
    assert counted["count"] == out.usage.prompt_tokens > plain["count"]
    bad = requests.post(f"{base_url}/tokenize", json={**body, "tools": "x"}, timeout=60)
    assert bad.status_code == 400 and "'tools'" in bad.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_call_is_a_function_call_item(client, engine, stream):
    """/v1/responses: the forced call of the chat path as a `function_call` item, streamed as
    OpenAI's argument deltas (the tiny test model has no tokenizer llguidance reads)."""
    from tests.server.api.test_responses_api import check_events

    tools = [{"type": "function", **t["function"]} for t in OPEN_TOOLS]
    fields = {"model": engine.model_name, "input": "What is 2 + 3?", "tools": tools,
              "tool_choice": {"type": "function", "name": "add"}, "temperature": 0,
              "max_output_tokens": 60}  # fmt: skip
    if stream:
        events = list(client.responses.create(stream=True, **fields))
        check_events(events)
        got = events[-1].response
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(pieces) == got.output[0].arguments
    else:
        got = client.responses.create(**fields)
    (item,) = got.output
    assert item.type == "function_call" and item.name == "add" and item.call_id
    assert got.status == "completed" and set(json.loads(item.arguments)) == {"a", "b"}


def test_none_answers_text(client, engine):
    out, headers = _create(client, engine, tool_choice="none")
    assert headers["x-toppings-tool-format"] == "generic"
    reply = out.choices[0]
    assert not reply.message.tool_calls and reply.message.content
    assert reply.finish_reason in ("stop", "length")


def test_auto_is_a_call_or_text(client, engine):
    for seed in range(3):
        out, headers = _create(client, engine, tool_choice="auto", temperature=0.8, seed=seed)
        assert headers["x-toppings-tool-format"] == "generic"
        reply = out.choices[0]
        if reply.message.tool_calls:
            (call,) = reply.message.tool_calls
            assert reply.finish_reason == "tool_calls" and call.function.name in SCHEMAS
            json.loads(call.function.arguments)
        else:
            assert reply.finish_reason in ("stop", "length") and reply.message.content is not None


@pytest.mark.parametrize("choice", ["required", NAMED, "auto"], ids=["required", "named", "auto"])
def test_streamed_calls_reassemble_to_the_unstreamed_reply(client, engine, choice):
    whole, _ = _create(client, engine, tool_choice=choice)
    calls: dict[int, dict] = {}
    content, finish = "", None
    stream = client.chat.completions.create(
        model=engine.model_name, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60,
        temperature=0, stream=True,
    )  # fmt: skip
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for delta in c.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = c.finish_reason or finish
    reply = whole.choices[0]
    assert finish == reply.finish_reason
    if reply.message.tool_calls:
        (call,) = reply.message.tool_calls
        assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
    else:
        assert not calls and content == reply.message.content


def test_a_round_trip_with_the_tool_result(client, engine):
    first, _ = _create(client, engine, tool_choice=NAMED)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'},
    ]
    out, headers = _create(client, engine, messages=messages, tool_choice="none")
    assert headers["x-toppings-tool-format"] == "generic"
    assert out.choices[0].message.content


class Weather(BaseModel):
    city: str = Field(max_length=20)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def test_parse_with_a_pydantic_tool(client, engine):
    out = client.chat.completions.parse(
        model=engine.model_name, messages=ASK, tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required", max_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "Weather"
    assert isinstance(call.function.parsed_arguments, Weather)


def test_the_generic_conversation():
    functions = tuple(json.dumps(t["function"]) for t in TOOLS)
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]  # fmt: skip
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    out = generic_tool_messages(history, Tools(functions, ToolChoice.REQUIRED))
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert all(f in out[0]["content"] for f in functions)
    assert json.loads(out[2]["content"]) == {"name": "get_time", "arguments": {"zone": "UTC"}}
    assert out[3] == {"role": "tool", "content": "12:00"}
    alone = generic_tool_messages(history[1:2], Tools(functions, ToolChoice.NAMED, "get_time"))
    assert alone[0]["role"] == "system" and "'get_time'" in alone[0]["content"]
    assert generic_tool_messages(history[1:2], Tools(functions, ToolChoice.NONE)) == history[1:2]
