"""vLLM's `truncate_prompt_tokens`: a prompt is cut to its last k tokens before anything else
(the context check, usage, generation), -1 keeping as many as the context holds; bad values
and the combination with `echo` are a 400 naming the field."""

from __future__ import annotations

import pytest

from toppings.server.api.app import create_app

GREEDY = {"temperature": 0, "ignore_eos": True}
CONTEXT = 512  # the tiny Llama's


@pytest.fixture(scope="module")
def http(tiny_engine):
    with tiny_engine({}, max_total_tokens=2048) as engine:
        yield create_app(engine).test_client()


def _post(http, body: dict, path: str = "/v1/completions") -> dict:
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.get_data()[:300]
    return answer.get_json()


def test_the_prompt_s_last_tokens_are_kept(http):
    prompt = [5 + (i * 7) % 200 for i in range(600)]  # longer than the context
    assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}).status_code == 400
    cut = _post(http, {"prompt": prompt, "max_tokens": 4, "truncate_prompt_tokens": 40, **GREEDY})
    tail = _post(http, {"prompt": prompt[-40:], "max_tokens": 4, **GREEDY})
    assert cut["usage"]["prompt_tokens"] == 40
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    whole = _post(http, {"prompt": prompt[:30], "max_tokens": 4, "truncate_prompt_tokens": -1,
                         **GREEDY})  # fmt: skip
    assert whole["usage"]["prompt_tokens"] == 30  # shorter than the context: as it is
    chat = {"messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 2}
    assert _post(http, {**chat, "truncate_prompt_tokens": 8}, "/v1/chat/completions")[
        "usage"]["prompt_tokens"] == 8  # fmt: skip


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
def test_bad_truncation_is_a_400(http, extra, words):
    answer = http.post("/v1/completions", json={"prompt": [5, 9, 14], "max_tokens": 2, **extra})
    assert answer.status_code == 400 and words in answer.get_json()["error"]["message"]
