"""OpenAI's metadata-class fields through the HTTP API: the answer is the one without them, the
response names them in X-Toppings-Ignored-Fields (streamed too) and the log says so once per
request; `reasoning_effort` is refused where the chat template reasons."""

from __future__ import annotations

import logging

import pytest

from toppings.server.api.app import create_app
from toppings.server.api.openai.choices import prompt_ids
from toppings.server.api.openai.schema import IGNORED_HEADER, parse_chat
from toppings.server.requests.request import RequestError

CHAT = [{"role": "user", "content": "hello there"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
EXTRA = {
    "metadata": {"trace": "t-1"}, "user": "u-9", "store": True, "service_tier": "auto",
    "parallel_tool_calls": False, "reasoning_effort": "low", "modalities": ["text"],
}  # fmt: skip


@pytest.fixture(scope="module")
def client(tiny_engine):
    with tiny_engine() as engine:
        yield create_app(engine).test_client()


def test_ignored_fields_change_nothing_and_are_named(client, caplog):
    plain = client.post("/v1/chat/completions", json={"messages": CHAT, **GREEDY})
    assert plain.status_code == 200 and IGNORED_HEADER not in plain.headers
    with caplog.at_level(logging.INFO, logger="toppings.server.api.openai.generation"):
        extra = client.post("/v1/chat/completions", json={"messages": CHAT, **GREEDY, **EXTRA})
    assert extra.status_code == 200, extra.get_json()
    text = lambda r: r.get_json()["choices"][0]["message"]["content"]  # noqa: E731
    assert text(extra) == text(plain)
    named = "metadata, service_tier, store, user, parallel_tool_calls, reasoning_effort, modalities"
    assert extra.headers[IGNORED_HEADER] == named
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert lines == [f"/v1/chat/completions: ignored {named} (they change nothing here)"]


def test_ignored_fields_are_named_on_streams_and_completions(client):
    body = {"prompt": "hello", **GREEDY, "stream": True, "user": "u-1"}
    streamed = client.post("/v1/completions", json=body)
    assert streamed.status_code == 200 and streamed.headers[IGNORED_HEADER] == "user"
    assert streamed.get_data(as_text=True).rstrip().endswith("data: [DONE]")


def test_a_typo_is_still_a_400_naming_it(client):
    answer = client.post("/v1/chat/completions", json={"messages": CHAT, "metdata": {}})
    assert answer.status_code == 400
    assert "'metdata' is not a field" in answer.get_json()["error"]["message"]


class Tokenizer:
    """What prompt_ids reads of a tokenizer: its template (rendered by
    server.chat_template.render), its special tokens, encoding."""

    special_tokens_map: dict[str, str] = {}

    def __init__(self, template: str):
        self.chat_template = template

    def get_chat_template(self, name, tools) -> str:
        return self.chat_template

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(text)]


@pytest.mark.parametrize("template", ["{% if enable_thinking %}x{% endif %}", "<think>{{ m }}"])
def test_reasoning_effort_is_refused_where_the_template_reasons(template):
    parsed = parse_chat({"messages": CHAT, "reasoning_effort": "high"}, "base")
    with pytest.raises(RequestError, match="'reasoning_effort' is not supported") as info:
        prompt_ids(parsed, Tokenizer(template), None)
    assert info.value.code == 400
    text = prompt_ids(parsed, Tokenizer("{{ messages[0].content }}"), None)
    assert text == [len("hello there")]
