"""Issue 17, row by row: what a vLLM/OpenAI user reaches for, through the `openai` client
against a real waitress server (tiny random Llama, one adapter)."""

from __future__ import annotations

import math
import time

import openai
import pytest
import requests

from toppings.server.api.app import create_app

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model_dir, tiny_engine):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("params_adapters")
    lora = make_random_adapter(root / "sql", tiny_model_dir, rank=8, seed=3)
    with tiny_engine({"sql": str(lora)}, max_total_tokens=8192, max_batch_size=64) as eng:
        yield eng


@pytest.fixture(scope="module")
def base_url(engine, serve_app):
    with serve_app(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url, openai_client):
    return openai_client(base_url, 60)


def test_n_choices_completions_and_chat(client):
    sampled = client.completions.create(
        model="sql", prompt="The cat", max_tokens=8, n=3, temperature=1.0, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.text for c in sampled.choices}) > 1, "seeded copies should differ"
    assert sampled.usage.completion_tokens == 24
    again = client.completions.create(
        model="sql", prompt="The cat", max_tokens=8, n=3, temperature=1.0, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]
    # Streamed, the chunks of the choices interleave; joined per index they give the same text.
    texts = ["", "", ""]
    for chunk in client.completions.create(
        model="sql", prompt="The cat", max_tokens=8, n=3, temperature=1.0, seed=5,
        stream=True, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in sampled.choices]
    chat = client.chat.completions.create(model="sql", messages=CHAT, max_tokens=5, n=2, **GREEDY)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    assert chat.usage.completion_tokens == 10
    streamed = ["", ""]
    for chunk in client.chat.completions.create(
        model="sql", messages=CHAT, max_tokens=5, n=2, stream=True, **GREEDY
    ):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in chat.choices]


def test_completion_logprobs(client, engine):
    full = client.completions.create(model="sql", prompt="The cat", max_tokens=6, logprobs=2,
                                     **GREEDY)  # fmt: skip
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == full.choices[0].text  # the tiny tokenizer decodes by concat
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 2 <= len(top) <= 3 and top[token] == value
        assert value == max(top.values())  # greedy: the chosen token is the most likely
    streamed = client.completions.create(
        model="sql", prompt="The cat", max_tokens=6, logprobs=2, stream=True, **GREEDY
    )
    values, offsets = [], []
    for chunk in streamed:
        if chunk.choices[0].logprobs is not None:
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert values == lp.token_logprobs and offsets == lp.text_offset


def test_chat_logprobs(client):
    kwargs = dict(model="sql", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kwargs, **GREEDY)
    content = full.choices[0].logprobs.content
    assert (
        len(content) == 5 and "".join(c.token for c in content) == full.choices[0].message.content
    )
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.bytes == list(entry.token.encode())
    chunks = client.chat.completions.create(stream=True, **kwargs, **GREEDY)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in
                c.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_echo_scores_the_prompt_like_generation(client, engine):
    """lm-eval's request: echo + logprobs + max_tokens 0 (and 1). The prompt's logprobs equal
    those the same tokens got when they were generated."""
    gen = client.completions.create(model="sql", prompt=[5, 9, 30], max_tokens=5, logprobs=1,
                                    **GREEDY)  # fmt: skip
    generated = gen.choices[0].logprobs.token_logprobs
    ids = [5, 9, 30] + [t for t in _ids(engine, gen.choices[0].logprobs.tokens)]
    for max_tokens in (0, 1):
        echo = client.completions.create(
            model="sql", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1, **GREEDY
        )
        lp = echo.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(ids) + max_tokens
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(lp.token_logprobs[3:8],
                                                                    generated))  # fmt: skip
        assert echo.choices[0].text.startswith(engine.tokenizer.decode(ids))
        assert echo.usage.prompt_tokens == len(ids)
        assert echo.usage.completion_tokens == max_tokens
    # echo without logprobs, and streamed
    plain = client.completions.create(model="sql", prompt="ab", max_tokens=2, echo=True, **GREEDY)
    assert plain.choices[0].text.startswith("ab") and plain.choices[0].logprobs is None
    chunks = list(client.completions.create(model="sql", prompt="ab", max_tokens=2, echo=True,
                                            logprobs=0, stream=True, **GREEDY))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def _ids(engine, tokens: list[str]) -> list[int]:
    return [engine.tokenizer.convert_tokens_to_ids(t) for t in tokens]


@pytest.mark.parametrize("prompts", [["The cat", "A dog sat", "x"], [[5, 9], [7, 7, 7], [40]]])
def test_lists_of_prompts(client, prompts):
    batch = client.completions.create(model="sql", prompt=prompts, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model="sql", prompt=prompt, max_tokens=4, **GREEDY)
        assert [c.text for c in batch.choices[2 * i : 2 * i + 2]] == [alone.choices[0].text] * 2
    single = [client.completions.create(model="sql", prompt=p, max_tokens=1, **GREEDY)
              for p in prompts]  # fmt: skip
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert batch.usage.completion_tokens == 4 * 6


def test_penalties_min_tokens_ignore_eos(client, engine):
    eos = engine.tokenizer.eos_token_id
    # EOS pushed to the top: the answer ends at once, unless min_tokens or ignore_eos hold it.
    bias = {str(eos): 100}
    stop_now = client.completions.create(model="sql", prompt="ab", max_tokens=8, temperature=0,
                                         logit_bias=bias)  # fmt: skip
    assert stop_now.usage.completion_tokens == 1 and stop_now.choices[0].finish_reason == "stop"
    held = client.completions.create(model="sql", prompt="ab", max_tokens=8, temperature=0,
                                     logit_bias=bias, extra_body={"min_tokens": 3})  # fmt: skip
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    ignored = client.completions.create(
        model="sql", prompt="ab", max_tokens=5, temperature=0, logit_bias=bias,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert ignored.usage.completion_tokens == 5 and ignored.choices[0].finish_reason == "length"
    # A strong bias forces one token; logprobs stay those of the model (raw).
    token = engine.tokenizer.convert_tokens_to_ids("q")
    forced = client.completions.create(model="sql", prompt="ab", max_tokens=4, logprobs=1,
                                       logit_bias={str(token): 100}, **GREEDY)  # fmt: skip
    assert forced.choices[0].text == "qqqq"
    assert all(v < 0 for v in forced.choices[0].logprobs.token_logprobs)
    # A mild bias makes "q" win every step; each penalty makes it lose some.
    nudged = dict(model="sql", prompt="ab", max_tokens=12, logit_bias={str(token): 6}, **GREEDY)
    assert client.completions.create(**nudged).choices[0].text == "q" * 12
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 1.0},
                    {"extra_body": {"repetition_penalty": 2.0, "ignore_eos": True}}):  # fmt: skip
        text = client.completions.create(**(nudged | penalty)).choices[0].text
        assert 0 < text.count("q") < 10, (penalty, text)
    chat = client.chat.completions.create(model="sql", messages=CHAT, max_tokens=3,
                                          presence_penalty=1.0, frequency_penalty=0.5,
                                          logit_bias={str(token): 100}, **GREEDY)  # fmt: skip
    assert chat.choices[0].message.content == "qqq"


def test_models_retrieve(client, engine):
    assert client.models.retrieve("sql").model_extra["parent"] == engine.model_name
    assert client.models.retrieve(engine.model_name).id == engine.model_name
    with pytest.raises(openai.NotFoundError, match="ghost"):
        client.models.retrieve("ghost")


@pytest.mark.parametrize(
    "method, path, status, words",
    [("GET", "/v1/nope", 404, "there is no route GET /v1/nope"),
     ("POST", "/nope/deeper", 404, "there is no route POST /nope/deeper"),
     ("DELETE", "/v1/completions", 405, "DELETE is not allowed on /v1/completions; it takes POST"),
     ("PUT", "/v1/models", 405, "it takes GET")],
)  # fmt: skip
def test_unknown_routes_and_methods_are_json(base_url, method, path, status, words):
    answer = requests.request(method, base_url + path, timeout=30)
    assert answer.status_code == status and answer.headers["Content-Type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == status and words in error["message"]


BAD = [
    (dict(prompt="x", n=17), r"'n' must be in \[1, 16\]"),
    (dict(prompt="x", logprobs=-1), r"'logprobs' must be in \[0, 20\]"),
    (dict(prompt="x", logprobs=21), r"'logprobs' must be in \[0, 20\]"),
    (dict(prompt="x", logit_bias={"100000": 1}), r"'logit_bias' token ids must be in \[0, "),
    (dict(prompt="x", logit_bias={"3": 101}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(prompt="x", max_tokens=0), "needs 'echo'"),
    (dict(prompt="x", presence_penalty=3), r"presence_penalty must be in \[-2, 2\]"),
    (dict(prompt="x", max_tokens=2, extra_body={"min_tokens": 5}), "min_tokens must be in"),
    (dict(prompt=["x", [1, 2]] * 129), "at most 256 prompts"),
    (dict(prompt=[[1], [2, 10**6]]), "token ids must be in"),
]


@pytest.mark.parametrize("kwargs, words", BAD)
def test_bad_fields_are_400_and_the_server_keeps_serving(client, kwargs, words):
    with pytest.raises(openai.BadRequestError, match=words) as info:
        client.completions.create(model="sql", **kwargs)
    assert info.value.body["code"] == 400 and info.value.body["type"] == "invalid_request_error"
    ok = client.completions.create(model="sql", prompt=["a", "b"], max_tokens=2, n=2)
    assert len(ok.choices) == 4


def test_chat_bad_fields(client):
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' must be in"):
        client.chat.completions.create(model="sql", messages=CHAT, logprobs=True, top_logprobs=30)
    with pytest.raises(openai.BadRequestError, match="needs 'logprobs': true"):
        client.chat.completions.create(model="sql", messages=CHAT, top_logprobs=3)


def test_tokenize_and_detokenize(base_url, engine):
    ids = requests.post(f"{base_url}/tokenize", json={"model": "sql", "prompt": "The cat"},
                        timeout=30).json()  # fmt: skip
    assert ids["tokens"] == engine.tokenizer.encode("The cat") and ids["count"] == len(
        ids["tokens"]
    )
    assert ids["max_model_len"] == engine.max_model_len
    chat = requests.post(f"{base_url}/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert chat["count"] > ids["count"]
    text = requests.post(f"{base_url}/detokenize", json={"tokens": ids["tokens"]},
                         timeout=30).json()  # fmt: skip
    assert (
        text == {"prompt": engine.tokenizer.decode(ids["tokens"])} and "The cat" in text["prompt"]
    )
    bad = requests.post(
        f"{base_url}/detokenize", json={"model": "ghost", "tokens": [1]}, timeout=30
    )
    assert bad.status_code == 404 and bad.json()["error"]["type"] == "not_found"


def test_tokenize_token_strs_special_tokens_and_unknown_fields(base_url, engine):
    """vLLM's `return_token_strs` (null unless asked) and chat-form `add_special_tokens` (the
    tokenizer's on top of the template's); a chat request's own fields are taken (its body
    counts as it is), a field no endpoint knows is a 400 naming it."""
    url = f"{base_url}/tokenize"
    plain = requests.post(url, json={"prompt": "The cat"}, timeout=30).json()
    named = requests.post(url, json={"prompt": "The cat", "return_token_strs": True},
                          timeout=30).json()  # fmt: skip
    assert plain["token_strs"] is None and named["tokens"] == plain["tokens"]
    assert named["token_strs"] == engine.tokenizer.convert_ids_to_tokens(plain["tokens"])
    chat = requests.post(url, json={"messages": CHAT}, timeout=30).json()
    both = requests.post(url, json={"messages": CHAT, "add_special_tokens": True},
                         timeout=30).json()  # fmt: skip
    text = engine.tokenizer.decode(chat["tokens"])
    assert both["tokens"] == engine.tokenizer.encode(text, add_special_tokens=True)
    as_chat = {"messages": CHAT, "max_tokens": 3, "temperature": 0.5, "tool_choice": "none"}
    assert requests.post(url, json=as_chat, timeout=30).json()["tokens"] == chat["tokens"]
    for path, body in [("/tokenize", {"prompt": "x", "messages": CHAT}),
                       ("/tokenize", {"messages": CHAT, "max_tokens": 3, "zzz": 1}),
                       ("/tokenize", {"prompt": "x", "zzz": 1}),
                       ("/detokenize", {"tokens": [1], "skip_special_tokens": True})]:  # fmt: skip
        bad = requests.post(f"{base_url}{path}", json=body, timeout=30)
        assert bad.status_code == 400, body
        assert "is not a field this server accepts" in bad.json()["error"]["message"]


def test_hanging_up_aborts_every_choice(base_url, engine):
    """A streamed n x prompts request whose client leaves: all its sequences end, KV is freed."""
    body = {"model": "sql", "prompt": ["ab", "cd"], "n": 3, "stream": True, "ignore_eos": True,
            "max_tokens": engine.max_model_len - 8}  # fmt: skip
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: {")
        assert len(engine.stats().to_json()["running"]) == 6
    deadline = time.monotonic() + 60
    while True:
        stats = engine.stats().to_json()
        if not stats["running"] and not stats["queue"]:
            break
        assert time.monotonic() < deadline, "the choices kept running after the client left"
        time.sleep(0.05)
    assert stats["free_kv_tokens"] == stats["max_total_tokens"]
