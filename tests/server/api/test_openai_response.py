"""Response shapes of issue 17 without an engine: choices of n x prompts, logprobs in OpenAI's
completions and chat shapes, echo (whole and streamed)."""

from __future__ import annotations

import json

from toppings.server.api.openai.logprobs import TokenText
from toppings.server.api.openai.response import ResponseMeta, final_response, stream_events
from toppings.server.api.openai.schema import parse_chat, parse_completion
from toppings.server.requests.request import RequestOutput, TokenLogprob

BASE = "tiny"


class Letters:
    """A tokenizer stub: token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)


def lp(token: int, value: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token, value, tuple(top))


def meta_for(parsed, prompt_ids, echo=()):
    return ResponseMeta.new(parsed, prompt_ids, TokenText(Letters()), echo)


def test_completion_echo_with_logprobs_and_n():
    parsed = parse_completion({"prompt": [[0, 1], [2]], "n": 2, "echo": True, "logprobs": 1}, BASE)
    meta = meta_for(parsed, [[0, 1], [2]], ("ab", "c"))
    scored = [None, lp(1, -2.0, (4, -0.1))]
    outs = [
        RequestOutput("r0", [3], "d", "length", output_tokens=1,
                      logprobs=[lp(3, -0.5, (3, -0.5))], prompt_logprobs=scored),
        RequestOutput("r1", [4], "e", "length", output_tokens=1,
                      logprobs=[lp(4, -0.9, (3, -0.5))], prompt_logprobs=scored),
        RequestOutput("r2", [], "", "length", prompt_logprobs=[None]),
        RequestOutput("r3", [], "", "length", prompt_logprobs=[None]),
    ]  # fmt: skip
    body = final_response(parsed, meta, outs)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["abd", "abe", "c", "c"]
    first = body["choices"][0]["logprobs"]
    assert first == {
        "tokens": ["a", "b", "d"],
        "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {"e": -0.1, "b": -2.0}, {"d": -0.5}],
        "text_offset": [0, 1, 2],
    }
    assert body["choices"][1]["logprobs"]["top_logprobs"][2] == {"d": -0.5, "e": -0.9}
    assert body["choices"][3]["logprobs"]["tokens"] == ["c"]
    # each prompt counted once, every choice's tokens counted
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def test_chat_logprobs_shape():
    parsed = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, BASE
    )
    logprobs = [lp(2, -0.1, (2, -0.1), (5, -3.0)), lp(3, -1.0, (4, -0.7), (3, -1.0))]
    out = RequestOutput("r", [2, 3], "cd", "stop", output_tokens=2, logprobs=logprobs)
    body = final_response(parsed, meta_for(parsed, [[9, 9]]), [out])
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "c", "logprob": -0.1, "bytes": [99],
        "top_logprobs": [{"token": "c", "logprob": -0.1, "bytes": [99]},
                         {"token": "f", "logprob": -3.0, "bytes": [102]}],
    }  # fmt: skip
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["e", "d"]


def _events(stream) -> list[dict]:
    frames = [f for f in "".join(stream).split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in frames[:-1]]


def test_stream_of_interleaved_choices_with_echo():
    parsed = parse_completion(
        {"prompt": "ab", "n": 2, "echo": True, "logprobs": 0, "stream": True,
         "stream_options": {"include_usage": True}}, BASE,
    )  # fmt: skip
    meta = meta_for(parsed, [[0, 1]], ("ab",))
    pl = [None, lp(1, -1.0)]
    outputs = [
        (1, RequestOutput("r1", [2], "c", None, logprobs=[lp(2, -0.2)], prompt_logprobs=pl)),
        (0, RequestOutput("r0", [3], "d", None, logprobs=[lp(3, -0.3)], prompt_logprobs=pl)),
        (1, RequestOutput("r1", [4], "e", "length", logprobs=[lp(4, -0.4)])),
        (0, RequestOutput("r0", [], "", "stop", logprobs=[])),
    ]
    events = _events(stream_events(parsed, meta, outputs))
    choices = [e["choices"][0] for e in events[:-1]]
    assert [(c["index"], c["text"]) for c in choices] == [(1, "abc"), (0, "abd"), (1, "e"), (0, "")]
    assert choices[0]["logprobs"]["tokens"] == ["a", "b", "c"]
    assert choices[0]["logprobs"]["token_logprobs"] == [None, -1.0, -0.2]
    assert choices[2]["logprobs"]["text_offset"] == [3]  # continues after "abc"
    assert choices[3]["finish_reason"] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
