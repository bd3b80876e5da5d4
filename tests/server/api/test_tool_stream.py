"""Tool calls streamed as OpenAI's deltas, without an engine: replies cut into token-sized
outputs go through `stream_events` and `final_response`, and the streamed deltas are checked
against the non-streamed reply (named, required, auto, cut short, n > 1)."""

from __future__ import annotations

import itertools
import json

import pytest

from toppings.server.api.openai.response import ResponseMeta, final_response, stream_events
from toppings.server.api.openai.schema import parse_chat
from toppings.server.api.openai.tool_calls import CallScanner, CallStream
from toppings.server.requests.request import RequestOutput

BASE = "tiny"
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    {"type": "function", "function": {"name": "get_weather"}},
]
NAMED = {"type": "function", "function": {"name": "get_time"}}
CALL = ['{"', "name", '":', ' "', "get", "_time", '",', ' "', "arguments", '":', ' {"', "zone",
        '":', ' "', "Europe", "/", "Paris", '"}', "}"]  # fmt: skip
ARGUMENTS = '{"zone": "Europe/Paris"}'


def body(choice, **fields) -> dict:
    messages = [{"role": "user", "content": "time?"}]
    return dict({"messages": messages, "tools": TOOLS, "tool_choice": choice}, **fields)


def outputs(pieces: list[str], finish: str = "stop", idx: int = 0) -> list[RequestOutput]:
    """One engine output per piece, the last with the finish reason."""
    last = len(pieces) - 1
    return [RequestOutput(f"r{idx}", [i], p, finish if i == last else None, output_tokens=i + 1)
            for i, p in enumerate(pieces)]  # fmt: skip


def streamed(request: dict, outs: list[tuple[int, RequestOutput]]) -> list[dict]:
    parsed = parse_chat(dict(request, stream=True), BASE)
    events = list(stream_events(parsed, ResponseMeta.new(parsed, [[0]]), outs))
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def whole(request: dict, outs: list[RequestOutput]) -> dict:
    parsed = parse_chat(request, BASE)
    merged = [RequestOutput(o[0].request_id, [], "".join(x.new_text for x in o),
                            o[-1].finish_reason, output_tokens=len(o)) for o in outs]  # fmt: skip
    return final_response(parsed, ResponseMeta.new(parsed, [[0]]), merged)


def joined(chunks: list[dict], idx: int = 0) -> dict:
    """A streamed choice as a client puts it together: content, each call, the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk["choices"]:
            if c["index"] != idx:
                continue
            content += c["delta"].get("content") or ""
            for d in c["delta"].get("tool_calls", ()):
                call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.get("id")
                call["name"] += d["function"].get("name") or ""
                call["arguments"] += d["function"].get("arguments") or ""
            finish = c["finish_reason"] or finish
    return {"content": content, "calls": list(calls.values()), "finish_reason": finish}


def tool_deltas(chunks: list[dict]) -> list[dict]:
    return [d for ch in chunks for c in ch["choices"] for d in c["delta"].get("tool_calls", ())]


def indexed(outs: list[RequestOutput], idx: int = 0) -> list[tuple[int, RequestOutput]]:
    return [(idx, o) for o in outs]


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_constrained_call_streams_as_a_header_then_argument_fragments(choice):
    request = body(choice, stream_options={"include_usage": True})
    chunks = streamed(request, indexed(outputs(CALL)))
    deltas = tool_deltas(chunks)
    header = deltas[0]
    assert header == {"index": 0, "id": header["id"], "type": "function",
                      "function": {"name": "get_time", "arguments": ""}}  # fmt: skip
    assert header["id"].startswith("call_")
    assert all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"}
               for d in deltas[1:])  # fmt: skip
    # Each argument token goes out as it comes; the wrapper's closing brace never does.
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert fragments == ['{"', "zone", '":', ' "', "Europe", "/", "Paris", '"}']
    # The header goes out with the name's closing quote, before the arguments' key.
    stream = CallStream(parse_chat(dict(request, stream=True), BASE).tools)
    sent = [stream.feed(p) for p in CALL]
    assert [i for i, deltas in enumerate(sent) if deltas][:2] == [CALL.index('",'), 10]
    reply = whole(body(choice), [outputs(CALL)])["choices"][0]
    (call,) = reply["message"]["tool_calls"]
    assert reply["message"]["content"] is None and reply["finish_reason"] == "tool_calls"
    assert call["function"] == {"name": "get_time", "arguments": ARGUMENTS}
    assert joined(chunks) == {"content": "", "finish_reason": "tool_calls",
                              "calls": [dict(call["function"], id=header["id"])]}  # fmt: skip
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["finish_reason"] is None for ch in chunks[:-2] for c in ch["choices"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(CALL)


def test_a_call_cut_short_keeps_its_partial_arguments_streamed_or_not():
    pieces = CALL[:-4]  # up to '"Europe'
    chunks = streamed(body(NAMED), indexed(outputs(pieces, "length")))
    reply = whole(body(NAMED), [outputs(pieces, "length")])["choices"][0]
    (call,) = reply["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "Europe'}
    assert reply["finish_reason"] == "length"
    assert joined(chunks)["calls"][0]["arguments"] == call["function"]["arguments"]
    assert joined(chunks)["finish_reason"] == "length"


def test_output_that_ends_before_the_name_is_text():
    pieces = ['{"', "name", '":', ' "', "get"]
    chunks = streamed(body(NAMED), indexed(outputs(pieces, "length")))
    reply = whole(body(NAMED), [outputs(pieces, "length")])["choices"][0]
    assert reply["message"] == {"role": "assistant", "content": '{"name": "get'}
    assert joined(chunks) == {"content": '{"name": "get', "calls": [], "finish_reason": "length"}


def test_choices_stream_their_own_calls():
    other = ['{"', "name", '":', ' "', "get", "_weather", '",', ' "', "arguments", '":', " {}", "}"]
    outs = [outputs(CALL, idx=0), outputs(other, idx=1)]
    # the two choices' outputs interleaved, as the engine's steps send them
    mixed = [(i, o) for pair in itertools.zip_longest(*outs) for i, o in enumerate(pair) if o]
    request = body("required", n=2)
    chunks = streamed(request, mixed)
    reply = whole(request, outs)["choices"]
    for idx in (0, 1):
        (call,) = reply[idx]["message"]["tool_calls"]
        assert [(c["name"], c["arguments"]) for c in joined(chunks, idx)["calls"]] == [
            (call["function"]["name"], call["function"]["arguments"])
        ]
    assert reply[1]["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_auto_text_streams_as_content_from_the_first_character_that_shows_it():
    pieces = [" ", " It", " is", " noon", "."]
    chunks = streamed(body("auto"), indexed(outputs(pieces)))
    contents = [c["delta"].get("content") for ch in chunks for c in ch["choices"]]
    # the role chunk, then the held whitespace with " It", then each token
    assert contents == ["", "  It", " is", " noon", "."]
    assert joined(chunks) == {"content": "  It is noon.", "calls": [], "finish_reason": "stop"}
    reply = whole(body("auto"), [outputs(pieces)])["choices"][0]
    assert reply["message"]["content"] == "  It is noon." and reply["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "pieces",
    [CALL, ["<tool_call>", "\n"] + CALL + ["\n", "</tool_call>"]],
)
def test_an_auto_call_is_held_to_the_end_then_sent_as_deltas(pieces):
    chunks = streamed(body("auto"), indexed(outputs(pieces)))
    # nothing but the role chunk until the reply has ended
    assert len(chunks) == 1 + 2
    header, arguments = tool_deltas(chunks)
    assert header["function"] == {"name": "get_time", "arguments": ""}
    assert arguments == {"index": 0, "function": {"arguments": ARGUMENTS}}
    reply = whole(body("auto"), [outputs(pieces)])["choices"][0]
    assert reply["message"]["tool_calls"][0]["function"]["arguments"] == ARGUMENTS
    assert joined(chunks)["finish_reason"] == reply["finish_reason"] == "tool_calls"


def test_an_auto_reply_that_looked_like_a_call_ends_as_text():
    pieces = CALL + [" and", " more"]
    chunks = streamed(body("auto"), indexed(outputs(pieces)))
    assert joined(chunks) == {"content": "".join(pieces), "calls": [], "finish_reason": "stop"}
    reply = whole(body("auto"), [outputs(pieces)])["choices"][0]
    assert reply["message"]["content"] == "".join(pieces)


@pytest.mark.parametrize(
    "text, arguments, is_complete",
    [
        ('{"name": "f", "arguments": {"a": "}\\"]", "b": [1, {"c": null}]}}',
         '{"a": "}\\"]", "b": [1, {"c": null}]}', True),
        ('{ "name" : "f" , "arguments" : 12 }', "12", True),
        ('{"name": "f", "arguments": 12', "12", False),
        ('{"name": "f", "arguments": "x\\\\"}', '"x\\\\"', True),
        ('{"name": "f", "arguments": {"a": [tr', '{"a": [tr', False),
        ('{"name": "f", "arg', "", False),
    ],
)  # fmt: skip
def test_scanner_reads_arguments_one_character_at_a_time(text, arguments, is_complete):
    scanner = CallScanner()
    for c in text:
        scanner.feed(c)
        assert arguments.startswith(scanner.arguments)
    assert (scanner.name, scanner.arguments, scanner.is_complete) == ("f", arguments, is_complete)
