"""A runaway chat template on a serving app (server.chat_template.sandbox): the chat that sets it
off (here by its own message: the client controls what a template loops over) gets a 400 and its
tokenizer copy goes back to the pool, while chats and completions beside it are answered; a
template that raises or touches a blocked attribute is a 400 on /tokenize as on chat."""

from __future__ import annotations

import threading

import pytest

import toppings.server.api.app as app_module
from toppings.server.api.app import ApiOptions, create_app
from toppings.server.api.tokenizer_pool import TokenizerPool

HANG_GUARD_S = 120  # only so that a broken build fails instead of hanging
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
RUNAWAY = (
    "{% if messages[-1]['content'] == 'spin' %}{% for a in range(100000) %}"
    "{% for b in range(100000) %}x{% endfor %}{% endfor %}{% endif %}" + CHATML
)
FAILING = (
    "{% if messages[-1]['content'] == 'raise' %}{{ raise_exception('no such turn') }}{% endif %}"
    "{% if messages[-1]['content'] == 'escape' %}{{ ''.__class__.__mro__ }}{% endif %}" + CHATML
)


def chat(content: str) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_engine):
    with tiny_engine(max_total_tokens=2048) as eng:
        yield eng


@pytest.fixture
def pools(monkeypatch) -> list[TokenizerPool]:
    """The pool each app makes, with 2 copies: fewer than the runaway chats sent at once."""
    made: list[TokenizerPool] = []

    class TwoCopies(TokenizerPool):
        def __init__(self, tokenizer, max_copies=None, chat_template=None):
            super().__init__(tokenizer, 2, chat_template)
            made.append(self)

    monkeypatch.setattr(app_module, "TokenizerPool", TwoCopies)
    return made


def post_all(app, posts: list[tuple[str, dict]]) -> list:
    """Every post at once, each from its own thread; their responses in order."""
    results: list = [None] * len(posts)

    def run(idx: int, path: str, body: dict) -> None:
        results[idx] = app.test_client().post(path, json=body)

    threads = [threading.Thread(target=run, args=(i, *p), daemon=True) for i, p in enumerate(posts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive(), "a request never ended"
    return results


def test_a_runaway_template_fails_its_own_chat_and_others_are_served(engine, pools):
    app = create_app(engine, ApiOptions(chat_template=RUNAWAY))
    posts = [("/v1/chat/completions", chat("spin"))] * 4 + [
        ("/v1/chat/completions", chat("hello")),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2, "temperature": 0}),
        ("/tokenize", {"messages": [{"role": "user", "content": "spin"}]}),
    ]
    *runaways, ok_chat, ok_completion, runaway_tokenize = post_all(app, posts)
    for response in (*runaways, runaway_tokenize):
        assert response.status_code == 400, response.get_data(as_text=True)
        error = response.get_json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 400
        assert error["message"].startswith("chat template rejected the messages: the chat template")
    assert ok_chat.status_code == 200 and ok_chat.get_json()["choices"][0]["message"]
    assert ok_completion.status_code == 200 and ok_completion.get_json()["choices"][0]["text"]
    (pool,) = pools
    assert pool.num_lent == 0 and pool.num_made <= pool.max_copies == 2
    after = app.test_client().post("/v1/chat/completions", json=chat("hello again"))
    assert after.status_code == 200


@pytest.mark.parametrize("content, words", [("raise", "no such turn"), ("escape", "unsafe")])
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_a_template_error_is_a_400_on_tokenize_as_on_chat(engine, pools, path, content, words):
    client = create_app(engine, ApiOptions(chat_template=FAILING)).test_client()
    body = (lambda text: {"messages": chat(text)["messages"]}) if path == "/tokenize" else chat
    response = client.post(path, json=body(content))
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == 400
    assert "chat template rejected the messages" in error["message"] and words in error["message"]
    assert client.post(path, json=body("fine")).status_code == 200
    assert pools[0].num_lent == 0
