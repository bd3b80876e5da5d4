"""OpenAI's Responses API with the `openai` client (its models parse every answer and event): a
response means what the chat request it stands for answers (the same greedy text and usage),
the token limit makes it "incomplete", function calls come back as items, streamed events
reassemble to the response, a stream whose client leaves ends its request, and what the server
cannot do is a 400 naming the field. The model's own calls, which need a tokenizer llguidance
reads: tests/server/api/test_tools_generic.py."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from toppings.server.api.app import create_app
from toppings.server.api.openai.responses_output import Reshaper

GREEDY = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def served(tiny_engine, serve_app, openai_client):
    """(openai client, base URL, engine) of the tiny engine's API."""
    with tiny_engine({}, max_total_tokens=2048) as engine:
        with serve_app(create_app(engine)) as url:
            yield openai_client(url, 120), url, engine


def _chat(client, engine, messages: list[dict], max_tokens: int = 12) -> dict:
    reply = client.chat.completions.create(model=engine.model_name, messages=messages,
                                           temperature=0, max_tokens=max_tokens)  # fmt: skip
    return reply.model_dump()


def test_a_response_is_its_chat_answer(served):
    client, _, engine = served
    got = client.responses.create(model=engine.model_name, input="Hello there",
                                  instructions="Be brief.", **GREEDY)  # fmt: skip
    want = _chat(client, engine, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hello there"}])  # fmt: skip
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant"
    assert got.output_text == want["choices"][0]["message"]["content"]
    assert got.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.output_tokens == want["usage"]["completion_tokens"]
    assert got.object == "response" and got.id.startswith("resp_")
    finish = want["choices"][0]["finish_reason"]
    assert got.status == ("incomplete" if finish == "length" else "completed")


def test_the_token_limit_makes_it_incomplete(served):
    client, _, engine = served
    got = client.responses.create(model=engine.model_name, input="Count:", temperature=0,
                                  max_output_tokens=3, extra_body={})  # fmt: skip
    assert got.usage.output_tokens <= 3
    if got.usage.output_tokens == 3:
        assert got.status == "incomplete" and got.output[0].status == "incomplete"
        assert got.incomplete_details.reason == "max_output_tokens"


def test_input_items_render_as_the_chat_messages(served):
    """Text parts, an earlier function call and its output: the chat's assistant tool_calls
    and tool message, the same answer."""
    client, _, engine = served
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Oslo"}'}  # fmt: skip
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "3C, rain"},
    ]
    got = client.responses.create(model=engine.model_name, input=items, **GREEDY)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3C, rain"},
    ]  # fmt: skip
    want = _chat(client, engine, messages)
    assert got.output_text == want["choices"][0]["message"]["content"]
    assert got.usage.input_tokens == want["usage"]["prompt_tokens"]


def test_logprobs_are_the_chat_answers(served):
    """`include` the text's logprobs: the chat's entries (with `top_logprobs` alternatives) in
    the text part, whole and streamed; `top_logprobs` without them is named ignored."""
    client, url, engine = served
    ask = {"model": engine.model_name, "input": "Hi", "include": ["message.output_text.logprobs"],
           "top_logprobs": 2, **GREEDY}  # fmt: skip
    chat = client.chat.completions.create(model=engine.model_name, temperature=0, max_tokens=12,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    choice = chat.model_dump()["choices"][0]
    want = choice["logprobs"]["content"]
    assert len(want) == chat.usage.completion_tokens and len(want[0]["top_logprobs"]) == 2
    if choice["finish_reason"] == "stop" and not isinstance(choice.get("stop_reason"), str):
        want = want[:-1]  # the stop token's entry: the Responses API gives none
    whole = requests.post(f"{url}/v1/responses", json=ask, timeout=60).json()
    assert _same_logprobs(whole["output"][0]["content"][0]["logprobs"], want)
    assert whole["top_logprobs"] == 2
    events = list(client.responses.create(**ask, stream=True))
    check_events(events)
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]  # fmt: skip
    final = events[-1].response.output[0].content[0].model_dump()["logprobs"]
    assert streamed == final and _same_logprobs(final, want)
    plain = requests.post(f"{url}/v1/responses", timeout=60,
                          json={**ask, "include": None})  # fmt: skip
    assert plain.json()["output"][0]["content"][0]["logprobs"] == []
    assert plain.headers["X-Toppings-Ignored-Fields"] == "top_logprobs"


def _same_logprobs(got: list[dict], want: list[dict]) -> bool:
    """The same tokens and alternatives, their logprobs within float32 rounding (a request's
    prompt may be read from the prefix cache, which sums in another order)."""

    def key(entries: list[dict]) -> list:
        return [(e["token"], e["bytes"], key(e.get("top_logprobs") or [])) for e in entries]

    values = [e["logprob"] for e in got], [e["logprob"] for e in want]
    return key(got) == key(want) and values[0] == pytest.approx(values[1], abs=1e-4)


def test_streamed_events_reassemble_to_the_response(served):
    client, _, engine = served
    events = list(client.responses.create(model=engine.model_name, input="Hi", stream=True,
                                          temperature=0, max_output_tokens=40))  # fmt: skip
    check_events(events)
    final = events[-1].response
    pieces = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(pieces) == final.output_text and final.usage.output_tokens > 0


def check_events(events: list) -> None:
    """Numbered from 0, opened and closed as OpenAI's, the items done those of the response."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    done = [e.item.model_dump() for e in events if e.type == "response.output_item.done"]
    assert done == [item.model_dump() for item in events[-1].response.output]


def test_closing_the_stream_closes_the_chat_stream():
    """The chat stream's close aborts the request and gives its slot back (ReleasingBody): the
    events made of it must close it, whether they were read to the end or not."""

    class ChatEvents:
        closed = False

        def __iter__(self):
            yield 'data: {"model": "m", "choices": [{"delta": {"content": "a"}}]}\n\n'
            yield 'data: {"model": "m", "choices": [{"delta": {"content": "b"}}]}\n\n'

        def close(self):
            self.closed = True

    for read in (3, None):
        chat = ChatEvents()
        events = Reshaper({"model": "m"})._events(chat)
        got = [next(events) for _ in range(read)] if read else list(events)
        events.close()
        assert chat.closed and got
    assert "response.completed" in got[-1]


def test_a_stream_whose_client_leaves_leaves_the_engine_idle(served):
    _, url, engine = served
    body = {"model": engine.model_name, "input": "Hi", "stream": True, "temperature": 0,
            "max_output_tokens": engine.max_model_len - 64}  # fmt: skip
    with requests.post(f"{url}/v1/responses", json=body, stream=True, timeout=60) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if b"response.output_text.delta" in line)
    deadline = time.monotonic() + 30
    while engine.stats().to_json()["running"] or engine.stats().to_json()["queue"]:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"previous_response_id": "resp_1"}, "'previous_response_id' is not supported"),
        ({"background": True}, "'background' is not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text must be a string, not null",
        ),
        (
            {
                "instructions": "x",
                "input": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"text": 5}]},
                ],
            },
            "input[1].content[0] must be an input_text",
        ),
        (
            {
                "instructions": "x",
                "input": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "input_text", "text": 5}]},
                ],
            },
            "input[1].content[0].text must be a string, not number",
        ),
        ({"reasoning": {"effort": "extreme"}}, "'reasoning.effort' must be one of"),
        ({"instructions": 5}, "'instructions' must be a string, not number"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "input[0].call_id 'c9' answers no function_call item before it",
        ),
        ({"tools": [{"type": "function", "name": 5}]}, "tools[0].name must be"),
        ({"include": ["file_search_call.results"]}, "'include' value 'file_search_call.results'"),
        ({"include": "message.output_text.logprobs"}, "'include' must be a list of strings"),
        ({"top_logprobs": 21}, "'top_logprobs' must be an integer from 0 to 20"),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type 'reasoning' is not supported"),
        ({"input": [3]}, "input[0] must be an object"),
        ({"input": []}, "'input' must be a string or a non-empty list"),
        ({"max_output_tokens": 0}, "'max_output_tokens' must be a positive integer"),
        ({"text": {"format": {"type": "xml"}}}, "'text.format.type' must be"),
        ({"truncation": "auto"}, "'truncation' must be 'disabled'"),
        ({"max_tokens": 5}, "'max_tokens' is not a field this server accepts in /v1/responses"),
        ({"reasoning": "high"}, "'reasoning' must be an object"),
        ({"prompt_cache_key": 5}, "'prompt_cache_key' must be a string"),
        ({"stream_options": {}}, "'stream_options' needs 'stream': true"),
        ({"text": {"format": {"type": "text"}, "tone": "x"}}, "'tone' is not a field"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "'text.format.schema'"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "'tool_choice' must"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id must be a string, not null",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input[0].arguments must be a string, not object",
        ),
    ],
)
def test_what_it_cannot_do_is_a_400(served, fields, words):
    _, url, engine = served
    body = {"model": engine.model_name, "input": "Hi", **fields}
    answer = requests.post(f"{url}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400
    assert words in answer.json()["error"]["message"]


def test_an_unknown_model_is_a_404(served):
    client, _, _ = served
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="ghost", input="Hi")


def test_ignored_fields_are_named_and_usage_has_openai_keys(served):
    _, url, engine = served
    body = {"model": engine.model_name, "input": "Hi", "max_output_tokens": 2, "user": "u",
            "safety_identifier": "s", "text": {"verbosity": "low"},
            "reasoning": {"summary": "auto"}}  # fmt: skip
    answer = requests.post(f"{url}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 200
    assert answer.headers["X-Toppings-Ignored-Fields"] == (
        "user, safety_identifier, reasoning.summary, text.verbosity"
    )
    details = answer.json()["usage"]["input_tokens_details"]
    assert details == {"cached_tokens": details["cached_tokens"], "cache_write_tokens": 0}


def test_a_response_the_server_cut_is_incomplete_and_a_stop_token_has_no_logprob():
    """A drain past its timeout ends a request with "abort": incomplete ("interrupted"), not
    completed; the stop token's logprob entry (it has no text) is left out, whole and
    streamed."""
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    stop = dict(entry, token="<|im_end|>", bytes=[])
    reply = {"model": "m", "usage": None, "choices": [{
        "message": {"content": "a"}, "finish_reason": "abort",
        "logprobs": {"content": [entry]}}]}  # fmt: skip
    got = Reshaper({"model": "m"}).whole(reply)
    assert got["status"] == "incomplete" and got["output"][0]["status"] == "incomplete"
    assert got["incomplete_details"] == {"reason": "interrupted"}
    reply["choices"][0].update(finish_reason="stop", stop_reason=None,
                               logprobs={"content": [entry, stop]})  # fmt: skip
    got = Reshaper({"model": "m"}).whole(reply)
    assert got["status"] == "completed" and got["output"][0]["content"][0]["logprobs"] == [entry]
    chunks = [{"model": "m", "choices": [{"delta": {"content": "a"},
                                          "logprobs": {"content": [entry]}}]},
              {"model": "m", "choices": [{"delta": {}, "logprobs": {"content": [stop]},
                                          "finish_reason": "abort"}]}]  # fmt: skip
    raw = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    events = [json.loads(e.split("data: ", 1)[1]) for e in Reshaper({"model": "m"})._events(raw)]
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "interrupted"}
    assert final["response"]["output"][0]["content"][0]["logprobs"] == [entry]


def test_a_second_item_gets_the_next_output_index():
    """A call, then text: the call is done at index 0 and the message added at index 1 (its
    text never written into the call)."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": ""}}  # fmt: skip
    more = {"index": 0, "function": {"arguments": "{}"}}
    deltas = [({"tool_calls": [call]}, None), ({"tool_calls": [more]}, None),
              ({"content": "ok"}, "stop")]  # fmt: skip
    chunks = [{"model": "m", "choices": [{"delta": d, "finish_reason": f}]} for d, f in deltas]
    raw = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    events = [json.loads(e.split("data: ", 1)[1]) for e in Reshaper({"model": "m"})._events(raw)]
    placed = [(e["type"], e.get("output_index")) for e in events if "output_index" in e]
    assert placed[0] == ("response.output_item.added", 0)
    assert ("response.output_item.done", 0) in placed
    assert ("response.output_item.added", 1) in placed
    assert ("response.output_text.delta", 1) in placed
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["function_call", "message"]
    assert (
        final["output"][0]["arguments"] == "{}" and final["output"][1]["content"][0]["text"] == "ok"
    )
