"""Parsing of OpenAI and native bodies, and the response/stream builders (no engine, no model)."""

from __future__ import annotations

import json

import pytest

from toppings.server.api.openai.response import (
    ResponseMeta,
    final_response,
    models_response,
    stream_events,
)
from toppings.server.api.openai.schema import parse_chat, parse_completion, parse_native
from toppings.server.requests.request import RequestError, RequestOutput

BASE = "tiny-llama"


def test_completion_defaults_and_model_names():
    p = parse_completion({"model": BASE, "prompt": "hi"}, BASE)
    assert (p.kind, p.model, p.adapter, p.prompt, p.max_tokens) == (
        "completion",
        BASE,
        None,
        "hi",
        None,
    )
    assert p.sampling == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "stop": (),
        "ignore_eos": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_tokens": 0,
        "logit_bias": (),
        "stop_token_ids": frozenset(),
        "allowed_token_ids": (),
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
    }
    assert parse_completion({"prompt": "hi"}, BASE).adapter is None
    p = parse_completion({"model": "sql", "prompt": "hi", "stop": "\n", "top_k": -1}, BASE)
    assert (p.model, p.adapter, p.sampling["stop"], p.sampling["top_k"]) == (
        "sql",
        "sql",
        ("\n",),
        0,
    )


@pytest.mark.parametrize(
    "prompt, expected",
    [("a", "a"), (["a"], "a"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion({"prompt": prompt}, BASE).prompt == expected


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "a", "max_tokens": "ten"}, "'max_tokens' must be an integer, not string"),
        ({"prompt": "a", "max_tokens": 2.5}, "'max_tokens' must be an integer"),
        ({"prompt": "a", "temperature": "hot"}, "'temperature' must be a number, not string"),
        ({"prompt": "a", "temperature": True}, "'temperature' must be a number, not boolean"),
        ({"prompt": "a", "stop": 5}, "'stop' must be a string or a list of strings"),
        ({"prompt": "a", "stop": ["x", 1]}, "'stop' must be a string or a list of strings"),
        ({"prompt": "a", "n": 17}, r"'n' must be in \[1, 16\], not 17"),
        ({"prompt": "a", "n": 0}, "'n' must be in"),
        ({"prompt": ["a"] * 20, "n": 16}, "at most 256 choices"),
        ({"prompt": ["a"] * 257}, "at most 256 prompts"),
        ({"prompt": "a", "seed": -1}, "'seed' must be in"),
        ({"prompt": "a", "stream": "yes"}, "'stream' must be a boolean"),
        ({"prompt": "a", "stream_options": []}, "'stream_options' must be an object"),
        ({"prompt": "a", "model": 3}, "'model' must be a string"),
        ({"prompt": "a", "max_tokens": 0}, "needs 'echo'"),
        ({"prompt": "a", "echo": 1}, "'echo' must be a boolean"),
        ({"prompt": "a", "best_of": 3}, "'best_of' is not supported"),
        ({"prompt": "a", "top_logprobs": 2}, "'top_logprobs' is not supported"),
        ({"prompt": "a", "logprobs": 21}, r"'logprobs' must be in \[0, 20\]"),
        ({"prompt": "a", "logprobs": -1}, "'logprobs' must be in"),
        ({"prompt": "a", "logprobs": True}, "'logprobs' must be an integer"),
        ({"prompt": "a", "logit_bias": {"x": 1}}, "keys must be token ids"),
        ({"prompt": "a", "logit_bias": {"3": "up"}}, "values must be numbers"),
        ({"prompt": "a", "logit_bias": [3]}, "'logit_bias' must be an object"),
        ({"prompt": "a", "presence_penalty": "x"}, "'presence_penalty' must be a number"),
        ({"prompt": "a", "min_tokens": 1.5}, "'min_tokens' must be an integer"),
        ({"prompt": ["a", 3]}, "only strings or only token-id lists"),
        ({"prompt": [[1], [2, "x"]]}, r"prompt\[1\]"),
        ({"prompt": [1, "b"]}, "token ids"),
        ({"prompt": [1, True]}, "token ids"),
        ({"prompt": 7}, "'prompt' must be a string or token ids, not number"),
        ({}, "'prompt' must be a string or token ids, not null"),
    ],
)
def test_completion_rejects(body, words):
    with pytest.raises(RequestError, match=words) as info:
        parse_completion(body, BASE)
    assert info.value.code == 400


def test_completion_fields_of_issue_17():
    body = {
        "prompt": ["a", "b"], "n": 3, "echo": True, "logprobs": 2, "max_tokens": 0,
        "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
        "min_tokens": 0, "logit_bias": {"7": -100, "3": 2.5}, "ignore_eos": True,
    }  # fmt: skip
    p = parse_completion(body, BASE)
    assert (p.prompts, p.n, p.echo, p.logprobs, p.max_tokens) == (["a", "b"], 3, True, 2, 0)
    assert p.sampling["logit_bias"] == ((3, 2.5), (7, -100.0))
    assert (p.sampling["presence_penalty"], p.sampling["repetition_penalty"]) == (0.5, 1.2)
    assert parse_completion({"prompt": [[1, 2], [3]]}, BASE).prompts == [[1, 2], [3]]


@pytest.mark.parametrize(
    "body, expected",
    [({"logprobs": True, "top_logprobs": 3}, 3), ({"logprobs": True}, 0), ({}, None),
     ({"logprobs": False, "top_logprobs": 0}, None)],
)  # fmt: skip
def test_chat_logprobs(body, expected):
    body["messages"] = [{"role": "user", "content": "x"}]
    assert parse_chat(body, BASE).logprobs == expected


@pytest.mark.parametrize(
    "body, words",
    [({"top_logprobs": 2}, "needs 'logprobs': true"),
     ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be in"),
     ({"logprobs": 1}, "'logprobs' must be a boolean"),
     ({"echo": True}, "'echo' is not supported")],
)  # fmt: skip
def test_chat_logprobs_rejects(body, words):
    body["messages"] = [{"role": "user", "content": "x"}]
    with pytest.raises(RequestError, match=words):
        parse_chat(body, BASE)


def test_neutral_values_of_unsupported_fields_pass():
    body = {"prompt": "a", "echo": False, "best_of": 1, "logprobs": None, "presence_penalty": 0}
    assert parse_completion(body, BASE).prompt == "a"


def test_chat_messages_and_token_limits():
    body = {
        "model": "sql",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    p = parse_chat(body, BASE)
    assert p.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    assert (p.adapter, p.max_tokens, p.stream, p.include_usage, p.prompt) == (
        "sql",
        5,
        True,
        True,
        None,
    )
    body["max_completion_tokens"] = 7
    assert parse_chat(body, BASE).max_tokens == 7


@pytest.mark.parametrize(
    "messages, words",
    [
        (None, "'messages' must be a non-empty list"),
        ([], "'messages' must be a non-empty list"),
        ("hi", "'messages' must be a non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"role": "wizard", "content": "x"}], r"messages\[0\].role must be one of"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "must be text parts"),
        ([{"role": "user", "content": []}], r"messages\[0\].content must not be an empty list"),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            r"messages\[0\].content\[0\].text must be a string, not null",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}],
                }
            ],
            r"messages\[0\].content\[1\].text must be a string, not number",
        ),
    ],
)
def test_chat_rejects(messages, words):
    with pytest.raises(RequestError, match=words):
        parse_chat({"messages": messages}, BASE)


def test_native_body():
    p = parse_native(
        {
            "adapter": "sql",
            "input_ids": [1, 2],
            "max_new_tokens": 4,
            "top_k": 5,
            "seed": 7,
            "ignore_eos": True,
            "stream": True,
        },
        BASE,
    )
    assert (p.kind, p.adapter, p.model, p.prompt, p.max_tokens) == (
        "native",
        "sql",
        "sql",
        [1, 2],
        4,
    )
    assert (p.sampling["top_k"], p.sampling["seed"], p.sampling["ignore_eos"], p.stream) == (
        5,
        7,
        True,
        True,
    )
    assert parse_native({"prompt": "x", "adapter": None}, BASE).adapter is None
    for body in ({}, {"prompt": "x", "input_ids": [1]}, {"input_ids": "12"}, {"prompt": 1}):
        with pytest.raises(RequestError):
            parse_native(body, BASE)


def _outputs(*finals: str | None) -> list[RequestOutput]:
    outs = [RequestOutput("r", [10 + i], f"t{i}", None) for i in range(len(finals) - 1)]
    outs.append(
        RequestOutput(
            "r",
            [99],
            "end",
            finals[-1],
            error="boom",
            output_tokens=len(finals),
            ttft_s=0.1,
            e2e_s=0.2,
        )
    )
    return outs


def _pairs(*finals: str | None) -> list[tuple[int, RequestOutput]]:
    return [(0, out) for out in _outputs(*finals)]


def _events(stream) -> list:
    text = "".join(stream)
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames) and frames[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in frames[:-1]]


def test_completion_stream_with_usage():
    p = parse_completion(
        {"model": "sql", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        BASE,
    )
    events = _events(stream_events(p, ResponseMeta("cmpl-1", 5, "sql", 3), _pairs(None, "stop")))
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["t0", "end"]
    assert events[1]["choices"][0]["finish_reason"] == "stop" and events[0]["usage"] is None
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    assert {e["id"] for e in events} == {"cmpl-1"} and events[0]["object"] == "text_completion"


def test_chat_stream_starts_with_role_and_sends_each_token():
    """A token whose text is held (an incomplete UTF-8 sequence) still gets its chunk, with
    empty content, as vLLM streams; an output without tokens or text gets none."""
    p = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True}, BASE)
    held, nothing = RequestOutput("r", [1], "", None), RequestOutput("r", [], "", None)
    outs = [(0, held), (0, nothing), *_pairs(None, "length")]
    events = _events(stream_events(p, ResponseMeta("c", 5, BASE, 3), outs))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": ""}, {"content": "t0"},
                      {"content": "end"}]  # fmt: skip
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)


def test_native_stream_and_error_event():
    p = parse_native({"prompt": "x", "stream": True}, BASE)
    events = _events(stream_events(p, ResponseMeta("g", 5, BASE, 3), _pairs(None, "stop")))
    assert events[0] == {"text": "t0", "token_ids": [10]}
    assert events[1] == {
        "text": "end",
        "token_ids": [99],
        "prompt_tokens": 3,
        "output_tokens": 2,
        "ttft_s": 0.1,
        "e2e_s": 0.2,
        "finish_reason": "stop",
        "stop_reason": None,
    }
    events = _events(stream_events(p, ResponseMeta("g", 5, BASE, 3), _pairs(None, "error")))
    assert events[-1] == {"error": {"message": "boom", "type": "server_error", "code": 500}}


def test_final_responses():
    out = RequestOutput("r", [1, 2], "hey", "stop", prompt_tokens=4, output_tokens=2)
    meta = ResponseMeta("id", 9, "sql", 4)
    chat = final_response(
        parse_chat({"messages": [{"role": "user", "content": "x"}]}, BASE), meta, [out]
    )
    assert chat["object"] == "chat.completion" and chat["model"] == "sql"
    assert chat["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hey"},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
        }
    ]
    assert chat["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    comp = final_response(parse_completion({"prompt": "x"}, BASE), meta, [out])
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == "hey"
    native = final_response(parse_native({"prompt": "x"}, BASE), meta, [out])
    assert native["token_ids"] == [1, 2] and native["finish_reason"] == "stop"


def test_models_list():
    adapters = [{"name": "sql", "rank": 8, "path": "/a", "target_modules": ["q_proj"]}]
    body = models_response(BASE, adapters, 1)
    assert body["object"] == "list"
    assert [(m["id"], m["parent"]) for m in body["data"]] == [(BASE, None), ("sql", BASE)]
