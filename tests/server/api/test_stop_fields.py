"""vLLM's `stop_token_ids`, `include_stop_str_in_output` and `skip_special_tokens`
(server.requests.request's SamplingParams): a stop token ends a greedy run exactly where the same
run without it reached that token (finish "stop", the token's text left out, `ignore_eos` or
not), `min_tokens` masks it as it masks EOS, a stop string is kept at the text's end only when
asked, special tokens' text is written only when asked (as the tokenizer decodes them), and bad
values are a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from tests.helpers import post_json

PROMPT = [5, 9, 14, 3, 22, 7]
GREEDY = {"temperature": 0, "ignore_eos": True}


def test_a_stop_token_ends_the_run_where_it_first_comes(tiny_app):
    http, tokenizer = tiny_app
    free = post_json(http, "/generate", {"input_ids": PROMPT, "max_new_tokens": 16, **GREEDY})
    ids = free["token_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a first occurrence
    never = next(t for t in range(1, 64) if t not in ids)  # a stop token the run never makes
    body = {"input_ids": PROMPT, "max_new_tokens": 16, "stop_token_ids": [never, ids[k]]}
    stopped = post_json(http, "/generate", {**body, **GREEDY})
    assert stopped["token_ids"] == ids[: k + 1]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == ids[k]
    assert free["stop_reason"] is None  # ended by its length
    assert stopped["text"] == tokenizer.decode(ids[:k], skip_special_tokens=True)
    # the same on the OpenAI route, with the count of what was generated
    plain = post_json(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, **GREEDY,
                                            "stop_token_ids": [ids[k]]})  # fmt: skip
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["choices"][0]["stop_reason"] == ids[k]  # vLLM's: the stop token's id
    assert plain["choices"][0]["text"] == stopped["text"]
    assert plain["usage"]["completion_tokens"] == k + 1
    # min_tokens masks it, as it masks EOS: never chosen, the run goes to its length
    masked = post_json(http, "/generate", {"input_ids": PROMPT, "max_new_tokens": 16,
                                           "min_tokens": 16, "stop_token_ids": [ids[k]],
                                           **GREEDY})  # fmt: skip
    assert ids[k] not in masked["token_ids"] and masked["finish_reason"] == "length"


def test_a_stop_string_is_kept_only_when_asked(tiny_app):
    http, _ = tiny_app
    body = {"prompt": PROMPT, "max_tokens": 24, **GREEDY}
    text = post_json(http, "/v1/completions", body)["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    at = text.find(stop)
    assert len(stop) == 2 and at > 0, text
    cut = post_json(http, "/v1/completions", {**body, "stop": [stop]})["choices"][0]
    keep = {**body, "stop": [stop], "include_stop_str_in_output": True}
    kept = post_json(http, "/v1/completions", keep)["choices"][0]
    assert cut["text"] == text[:at] and cut["finish_reason"] == "stop"
    assert kept["text"] == text[: at + 2] and kept["finish_reason"] == "stop"
    assert cut["stop_reason"] == kept["stop_reason"] == stop  # vLLM's: the stop string


def _streamed_choices(http, path: str, body: dict) -> list[dict]:
    answer = http.post(path, json={**body, "stream": True})
    assert answer.status_code == 200, answer.get_data()[:300]
    lines = answer.get_data(as_text=True).splitlines()
    return [c for ln in lines if ln.startswith("data: {") for c in json.loads(ln[6:])["choices"]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_stop_reason_streams_on_the_last_chunk(tiny_app, path):
    """Every streamed choice carries vLLM's `stop_reason`: null until the chunk that ends it,
    then the stop string that did; null at a length end."""
    http, _ = tiny_app
    chat = path.endswith("chat/completions")
    body = {"max_tokens": 24, **GREEDY}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT}
    free = post_json(http, path, body)["choices"][0]
    text = free["message"]["content"] if chat else free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2 and text.find(stop) > 0, text
    for stops, finish, reason in (([stop], "stop", stop), ([], "length", None)):
        choices = _streamed_choices(http, path, {**body, "stop": stops})
        assert all("stop_reason" in c for c in choices)
        assert [c["stop_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == (finish, reason)


def test_special_tokens_are_written_only_when_asked(tiny_app):
    http, tokenizer = tiny_app
    bos = tokenizer.bos_token_id
    body = {"input_ids": PROMPT, "max_new_tokens": 3, **GREEDY, "logit_bias": {str(bos): 100}}
    hidden = post_json(http, "/generate", body)
    shown = post_json(http, "/generate", {**body, "skip_special_tokens": False})
    assert hidden["token_ids"] == shown["token_ids"] == [bos] * 3
    assert hidden["text"] == "" and tokenizer.decode([bos]) != ""
    assert shown["text"] == tokenizer.decode([bos] * 3, skip_special_tokens=False)
    # A prompt of ids echoes every token, special ones too, as vLLM decodes it: the logprobs
    # list each token, and each text_offset points at that token's text in the choice's text.
    echo = {"prompt": [bos, *PROMPT], "max_tokens": 1, "echo": True, "logprobs": 0, **GREEDY}
    for skip in (True, False):
        answer = post_json(http, "/v1/completions", {**echo, "skip_special_tokens": skip})
        (choice,) = answer["choices"]
        assert choice["text"].startswith(tokenizer.decode([bos, *PROMPT]))
        logprobs = choice["logprobs"]
        for token, offset in list(zip(logprobs["tokens"], logprobs["text_offset"]))[:-1]:
            assert choice["text"][offset : offset + len(token)] == token


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"stop_token_ids": 5}, "'stop_token_ids' must be a list of token ids"),
        ({"stop_token_ids": [-1]}, "'stop_token_ids' must be a list of token ids"),
        ({"stop_token_ids": [True]}, "'stop_token_ids' must be a list of token ids"),
        ({"stop_token_ids": [10**9]}, "'stop_token_ids' must be in [0, "),
        ({"stop_token_ids": list(range(65))}, "at most 64 ids"),
        ({"include_stop_str_in_output": "yes"}, "must be a boolean"),
        ({"skip_special_tokens": 0}, "'skip_special_tokens' must be a boolean"),
    ],
    ids=[
        "not a list",
        "negative",
        "a boolean",
        "past the vocabulary",
        "too many",
        "not a bool",
        "skip not a bool",
    ],
)
def test_bad_values_are_a_400_naming_the_field(tiny_app, fields, words):
    http, _ = tiny_app
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/generate", {"prompt": "hi"})):
        answer = http.post(path, json={**body, "max_tokens" if path != "/generate"
                                       else "max_new_tokens": 2, **fields})  # fmt: skip
        assert answer.status_code == 400, (path, answer.get_data()[:300])
        assert words in answer.get_json()["error"]["message"], answer.get_json()
