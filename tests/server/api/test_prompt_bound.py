"""Huge prompts and the tokenizer: a text over the character bound is refused before anything
tokenizes it, the body size is capped (413), and one request's tokenization never waits for
another's (the handlers tokenize on copies lent by a TokenizerPool, not under one lock)."""

from __future__ import annotations

import threading

import pytest

from toppings.server.api.app import ApiOptions, create_app
from toppings.server.api.openai.choices import max_token_chars
from toppings.server.api.tokenizer_pool import TokenizerPool

HANG_GUARD_S = 60  # only so that a broken build fails instead of hanging


@pytest.fixture(scope="module")
def engine(tiny_engine):
    with tiny_engine(max_total_tokens=2048) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    return create_app(engine).test_client()


class TokenizerSpy:
    """Counts the tokenizer class's encode and chat-template calls (copies share the class);
    an encode of the text `block_on` waits until `release` is set."""

    def __init__(self, monkeypatch, tokenizer, block_on: str | None = None):
        self.calls = 0
        self.block_on = block_on
        self.blocked = threading.Event()
        self.release = threading.Event()
        cls = type(tokenizer)
        encode, template = cls.encode, cls.get_chat_template  # every chat render asks it first

        def spy_encode(tok, text, *args, **kwargs):
            self.calls += 1
            if text == self.block_on:
                self.blocked.set()
                assert self.release.wait(HANG_GUARD_S)
            return encode(tok, text, *args, **kwargs)

        def spy_template(tok, *args, **kwargs):
            self.calls += 1
            return template(tok, *args, **kwargs)

        monkeypatch.setattr(cls, "encode", spy_encode)
        monkeypatch.setattr(cls, "get_chat_template", spy_template)


def over_bound(engine) -> str:
    return "a" * (engine.max_model_len * max_token_chars(engine.tokenizer) + 1)


def halves(text: str) -> list[dict[str, str]]:
    """Two messages, each under the bound, together over it."""
    half = len(text) // 2
    return [{"role": "user", "content": text[:half]}, {"role": "user", "content": text[half:]}]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1}),
        ("/v1/completions", lambda text: {"prompt": ["hi", text], "max_tokens": 1}),
        ("/generate", lambda text: {"prompt": text}),
        ("/tokenize", lambda text: {"prompt": text}),
        ("/v1/chat/completions", lambda text: {"messages": halves(text)}),
        ("/tokenize", lambda text: {"messages": [{"role": "user", "content": text}]}),
    ],
    ids=["completion", "prompt list", "native", "tokenize", "chat (sum)", "tokenize chat"],
)
def test_text_over_the_bound_is_refused_before_tokenizing(monkeypatch, engine, client, path, body):
    spy = TokenizerSpy(monkeypatch, engine.tokenizer)
    text = over_bound(engine)
    response = client.post(path, json=body(text))
    assert response.status_code == 400, response.get_data(as_text=True)
    message = response.get_json()["error"]["message"]
    assert f"at most {len(text) - 1} ({engine.max_model_len} tokens" in message
    assert spy.calls == 0
    ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert ok.status_code == 200 and spy.calls > 0


def test_text_at_the_bound_is_tokenized(monkeypatch, engine, client):
    spy = TokenizerSpy(monkeypatch, engine.tokenizer)
    text = over_bound(engine)[:-1]
    response = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert response.status_code == 200 and spy.calls == 1
    assert response.get_json()["count"] <= len(text)


def test_max_prompt_tokens_tightens_the_bound(monkeypatch, engine):
    spy = TokenizerSpy(monkeypatch, engine.tokenizer)
    client = create_app(engine, ApiOptions(max_prompt_tokens=8)).test_client()
    text = "a" * (8 * max_token_chars(engine.tokenizer) + 1)
    response = client.post("/v1/completions", json={"prompt": text})
    assert response.status_code == 400 and "8 tokens" in response.get_json()["error"]["message"]
    assert spy.calls == 0


def test_body_over_the_default_limit_gets_413(engine, client):
    """A 15 MB prompt is refused by its size before the body is read or parsed."""
    response = client.post("/v1/completions", json={"prompt": "x" * (15 << 20)})
    assert response.status_code == 413
    error = response.get_json()["error"]
    assert error["code"] == 413 and error["type"] == "invalid_request_error"
    assert "--max-request-bytes" in error["message"]


def test_max_request_bytes(engine):
    client = create_app(engine, ApiOptions(max_request_bytes=300)).test_client()
    response = client.post("/tokenize", json={"prompt": "x" * 300})
    assert response.status_code == 413 and response.get_json()["error"]["code"] == 413
    assert client.post("/tokenize", json={"prompt": "x" * 100}).status_code == 200


def post_in_thread(app, path: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []

    def run() -> None:
        result.append(app.test_client().post(path, json=body))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("second_path", ["/tokenize", "/v1/completions", "/v1/chat/completions"])
def test_a_blocked_tokenization_does_not_hold_up_another_request(monkeypatch, engine, second_path):
    spy = TokenizerSpy(monkeypatch, engine.tokenizer, block_on="wait for me")
    app = create_app(engine)
    first, first_result = post_in_thread(app, "/tokenize", {"prompt": "wait for me"})
    try:
        assert spy.blocked.wait(HANG_GUARD_S)
        body = {"prompt": "go ahead", "max_tokens": 1}
        if second_path == "/v1/chat/completions":
            body = {"messages": [{"role": "user", "content": "go ahead"}], "max_tokens": 1}
        second, second_result = post_in_thread(app, second_path, body)
        second.join(HANG_GUARD_S)
        assert second_result and second_result[0].status_code == 200  # while the first waits
        assert not first_result
    finally:
        spy.release.set()
    first.join(HANG_GUARD_S)
    assert first_result and first_result[0].status_code == 200


def test_pool_lends_each_copy_to_one_borrower(engine):
    pool = TokenizerPool(engine.tokenizer, max_copies=2)
    with pool.borrow() as a, pool.borrow() as b:
        assert a is not b and a is not engine.tokenizer
        assert a.encode("hello there") == engine.tokenizer.encode("hello there")
    with pool.borrow() as c:
        assert c in (a, b)
    assert pool.num_made == 2


def test_pool_makes_its_copies_before_the_first_borrower(engine, monkeypatch):
    """The first copies are made with the pool (before /health): the first borrowers, the first
    request after start-up among them, never wait for one to be made (issue 63)."""
    from toppings.server.api import tokenizer_pool

    assert TokenizerPool(engine.tokenizer, max_copies=6).num_made == tokenizer_pool.MIN_COPIES
    pool = TokenizerPool(engine.tokenizer, max_copies=3)
    assert pool.num_made == 3 and pool.num_lent == 0

    def no_copy(_):
        raise AssertionError("a copy was made on a borrower's path")

    monkeypatch.setattr(tokenizer_pool.copy, "deepcopy", no_copy)
    with pool.borrow() as a, pool.borrow() as b, pool.borrow() as c:
        assert len({id(a), id(b), id(c)}) == 3 and engine.tokenizer not in (a, b, c)
        assert pool.num_lent == 3
    assert pool.num_made == 3


def test_pool_not_made_ready_copies_on_first_use(engine):
    pool = TokenizerPool(engine.tokenizer, max_copies=2, ready=0)
    assert pool.num_made == 0
    with pool.borrow() as a:
        assert pool.num_made == 1 and a.encode("hi") == engine.tokenizer.encode("hi")
    assert pool.num_made == 1


def test_pool_borrower_past_max_copies_waits_for_a_return(engine):
    pool = TokenizerPool(engine.tokenizer, max_copies=1)
    got = threading.Event()

    def borrow() -> None:
        with pool.borrow():
            got.set()

    with pool.borrow():
        waiter = threading.Thread(target=borrow, daemon=True)
        waiter.start()
        waiter.join(0.2)  # a chance to (wrongly) get a copy while the only one is lent
        assert not got.is_set()
    assert got.wait(HANG_GUARD_S) and pool.num_made == 1


def test_no_token_spans_more_than_max_token_chars(smollm2_dir):
    """The bound holds on a real byte-level BPE vocabulary (SmolLM2: 81)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    bound = max_token_chars(tokenizer)
    assert bound == 81
    longest = max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))
    assert longest <= bound
