"""Tool calling with the `openai` client on SmolLM2 given a chat template that renders tools:
named and required calls (base and adapter), streamed call deltas, a round trip with a `tool`
message, and the 400s."""

from __future__ import annotations

import json
import os
import types

import jsonschema
import pytest
import requests

from toppings.server.api.app import create_app
from toppings.server.api.openai.tool_calls import Call, parse_call
from toppings.server.api.openai.tools import ToolChoice, Tools, template_renders_tools
from toppings.server.config import EngineConfig
from toppings.server.runtime import build_engine

pytestmark = pytest.mark.slow
ADAPTER = "caller"
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions; to call one, reply with "
    '{"name": NAME, "arguments": {...}} only.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}'
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{% for c in message.tool_calls %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": TIME}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_dir):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("tools_model")
    model = root / "smollm2-tools"
    model.mkdir()
    for name in os.listdir(smollm2_dir):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(smollm2_dir, name), model / name)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    loras = {ADAPTER: str(make_random_adapter(root / ADAPTER, smollm2_dir, rank=8, seed=9))}
    eng = build_engine(str(model), EngineConfig(dtype="float32", max_total_tokens=8192), loras)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def base_url(engine, serve_app):
    with serve_app(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url, openai_client):
    return openai_client(base_url, 300)


@pytest.mark.parametrize("adapter", [None, ADAPTER])
def test_named_call(client, engine, adapter):
    out = client.chat.completions.create(
        model=adapter or engine.model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_call_picks_a_tool(client, engine):
    out = client.chat.completions.create(
        model=ADAPTER, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
        temperature=0.9, seed=3, n=3,
    )  # fmt: skip
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_call_deltas_reassemble_to_the_call(client, engine, choice):
    """The openai client's stream, joined per tool-call index as its users do, gives the
    non-streamed call; the arguments arrive in several deltas as they are generated."""
    kwargs = dict(model=engine.model_name, messages=ASK, tools=TOOLS, tool_choice=choice,
                  max_tokens=60, temperature=0)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    num_argument_deltas, finish = 0, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            assert not c.delta.content
            for delta in c.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                num_argument_deltas += bool(delta.function.arguments)
            finish = c.finish_reason or finish
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (w.function.name, w.function.arguments) for w in whole
    ]
    assert calls[0]["id"].startswith("call_") and finish == "tool_calls"
    assert num_argument_deltas > 1


def test_raw_streamed_call_deltas(base_url, engine):
    """The SSE deltas in OpenAI's form: one header delta with id, type, name and arguments "",
    then argument fragments with neither id nor name, joining to the non-streamed arguments."""
    body = {"model": engine.model_name, "messages": ASK, "tools": TOOLS, "max_tokens": 60,
            "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            }  # fmt: skip
    url = f"{base_url}/v1/chat/completions"
    whole = requests.post(url, json=body, timeout=300).json()["choices"][0]["message"]
    streamed = dict(body, stream=True, stream_options={"include_usage": True})
    reply = requests.post(url, json=streamed, timeout=300)
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    choices = [c for chunk in chunks for c in chunk["choices"]]
    deltas = [d for c in choices for d in c["delta"].get("tool_calls", ())]
    header, fragments = deltas[0], deltas[1:]
    assert header == {"index": 0, "id": header["id"], "type": "function",
                      "function": {"name": "get_time", "arguments": ""}}  # fmt: skip
    assert len(fragments) > 1
    assert all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"}
               and d["index"] == 0 for d in fragments)  # fmt: skip
    (call,) = whole["tool_calls"]
    assert "".join(d["function"]["arguments"] for d in fragments) == call["function"]["arguments"]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]


def test_round_trip_with_a_tool_message(client, engine):
    call = client.chat.completions.create(
        model=engine.model_name, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=60, temperature=0,
    ).choices[0].message  # fmt: skip
    messages = ASK + [
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temp_c": 21}'},
    ]
    reply = client.chat.completions.create(
        model=engine.model_name, messages=messages, tools=TOOLS, tool_choice="none",
        max_tokens=16, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "nope"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": TOOLS, "logprobs": True}, "logprobs"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "structured-output"),
    ],
)  # fmt: skip
def test_bad_tool_input_is_a_400(base_url, engine, fields, named):
    body = dict({"model": engine.model_name, "messages": ASK}, **fields)
    reply = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]["message"]


def test_completions_refuse_tools(base_url, engine):
    body = {"model": engine.model_name, "prompt": "hi", "tools": TOOLS}
    reply = requests.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "tools" in reply.json()["error"]["message"]


def test_a_template_without_tools_gets_the_generic_format():
    assert not template_renders_tools(types.SimpleNamespace(chat_template="{{ messages }}"))
    assert template_renders_tools(types.SimpleNamespace(chat_template=TOOLS_TEMPLATE))


def test_auto_reply_parsed_as_a_call_only_when_it_is_one():
    tools = Tools(tuple(json.dumps(t["function"]) for t in TOOLS), ToolChoice.AUTO)
    call = parse_call(tools, '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
                             "</tool_call>")  # fmt: skip
    assert call == Call("get_time", '{"zone": "UTC"}')
    assert parse_call(tools, '{"name": "get_time", "parameters": {}}') == Call("get_time", "{}")
    assert parse_call(tools, '{"name": "unknown", "arguments": {}}') is None
    assert parse_call(tools, '{"name": "get_time", "arguments": {}} and more') is None
    assert parse_call(tools, "It is sunny.") is None
