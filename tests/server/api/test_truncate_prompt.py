"""vLLM's `truncate_prompt_tokens`: a prompt is cut to its last k tokens before anything else
(the context check, usage, generation), -1 keeping as many as the context holds; bad values
and the combination with `echo` are a 400 naming the field."""

from __future__ import annotations

import pytest

from tests.helpers import post_json

GREEDY = {"temperature": 0, "ignore_eos": True}
CONTEXT = 512  # the tiny Llama's


def test_the_prompt_s_last_tokens_are_kept(tiny_app):
    http, _ = tiny_app
    path = "/v1/completions"
    prompt = [5 + (i * 7) % 200 for i in range(600)]  # longer than the context
    assert http.post(path, json={"prompt": prompt, "max_tokens": 4}).status_code == 400
    cut = post_json(http, path, {"prompt": prompt, "max_tokens": 4, "truncate_prompt_tokens": 40,
                                 **GREEDY})  # fmt: skip
    tail = post_json(http, path, {"prompt": prompt[-40:], "max_tokens": 4, **GREEDY})
    assert cut["usage"]["prompt_tokens"] == 40
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    whole = post_json(http, path, {"prompt": prompt[:30], "max_tokens": 4,
                                   "truncate_prompt_tokens": -1, **GREEDY})  # fmt: skip
    assert whole["usage"]["prompt_tokens"] == 30  # shorter than the context: as it is
    chat = {"messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 2}
    answer = post_json(http, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 8})
    assert answer["usage"]["prompt_tokens"] == 8


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"truncate_prompt_tokens": 0}, "must be -1 (the context) or at least 1"),
        ({"truncate_prompt_tokens": -2}, "must be -1 (the context) or at least 1"),
        ({"truncate_prompt_tokens": "8"}, "'truncate_prompt_tokens' must be an integer"),
        ({"truncate_prompt_tokens": CONTEXT + 1}, "exceeds this model's context of 512"),
        ({"truncate_prompt_tokens": 8, "echo": True}, "with 'echo' is not supported"),
    ],
    ids=["zero", "below -1", "a string", "past the context", "with echo"],
)
def test_bad_truncation_is_a_400(tiny_app, extra, words):
    http, _ = tiny_app
    answer = http.post("/v1/completions", json={"prompt": [5, 9, 14], "max_tokens": 2, **extra})
    assert answer.status_code == 400 and words in answer.get_json()["error"]["message"]
