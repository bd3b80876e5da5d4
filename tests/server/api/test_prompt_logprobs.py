"""vLLM's `prompt_logprobs` (server.api.openai.logprobs): each prompt token's logprob, its rank
in the vocabulary and the k most likely tokens there equal transformers' log-softmax of the same
prompt (float32, within 1e-4), a choice's on completions and the response's on chat; what it
cannot be combined with is a 400 naming it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import post_json

TOL = 1e-4
PROMPT = [5, 9, 14, 3, 22, 7, 31, 2, 17, 40, 11, 6]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """log_softmax of transformers' logits at every position of a prompt, [len, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], dim=-1)

    return run


def check(scored: list, ids: list[int], k: int, ref: torch.Tensor, tokenizer) -> None:
    assert len(scored) == len(ids) and scored[0] is None
    for pos in range(1, len(ids)):
        want, token = ref[pos - 1], ids[pos]  # [V]: what position pos - 1 predicts
        entries = scored[pos]
        own = entries[str(token)]
        assert abs(own["logprob"] - float(want[token])) < TOL
        above = (want > want[token] + TOL).sum().item(), (want > want[token] - TOL).sum().item()
        assert above[0] + 1 <= own["rank"] <= above[1] + 1  # ties within TOL either way
        assert own["decoded_token"] == tokenizer.decode([token], skip_special_tokens=False)
        top = want.topk(k)
        ranked = {int(t): r for r, t in enumerate(top.indices.tolist(), 1)}
        assert set(entries) == {str(token)} | {str(t) for t in ranked}
        for t, r in ranked.items():
            if t != token:
                assert entries[str(t)]["rank"] == r
                assert abs(entries[str(t)]["logprob"] - float(want[t])) < TOL


@pytest.mark.parametrize("k", [0, 3])
def test_completions_score_each_choice_s_prompt(tiny_app, reference, k):
    http, tokenizer = tiny_app
    body = {"prompt": PROMPT, "max_tokens": 2, "n": 2, "prompt_logprobs": k, **GREEDY}
    choices = post_json(http, "/v1/completions", body)["choices"]
    for choice in choices:
        check(choice["prompt_logprobs"], PROMPT, k, reference(PROMPT), tokenizer)
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert choices[0]["logprobs"] is None  # the output's logprobs only when asked
    plain = post_json(http, "/v1/completions", {**body, "prompt_logprobs": None})["choices"][0]
    assert "prompt_logprobs" not in plain


def test_chat_scores_its_rendered_prompt_once(tiny_app, reference):
    http, tokenizer = tiny_app
    messages = [{"role": "user", "content": "hello there"}]
    body = {"messages": messages, "max_tokens": 2, "prompt_logprobs": 2, **GREEDY}
    answer = post_json(http, "/v1/chat/completions", body)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)  # as the server renders a chat
    assert answer["usage"]["prompt_tokens"] == len(ids)
    check(answer["prompt_logprobs"], ids, 2, reference(ids), tokenizer)
    assert "prompt_logprobs" not in answer["choices"][0]


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"prompt_logprobs": 2, "stream": True}, "'prompt_logprobs' with 'stream'"),
        ({"prompt_logprobs": 2, "echo": True, "logprobs": 1}, "with 'echo' and 'logprobs'"),
    ],
)
def test_what_it_cannot_be_is_a_400_naming_it(tiny_app, extra, words):
    http, _ = tiny_app
    answer = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra})
    assert answer.status_code == 400
    assert words in answer.get_json()["error"]["message"]


@pytest.mark.parametrize(
    "body, fits_n",
    [
        ({"prompt_logprobs": 3}, 2),  # 11 scored prompt tokens x 4 entries a choice: 44
        ({"echo": True, "logprobs": 1}, 3),  # 11 x 2 for the prompt, 2 x 2 for the output: 26
        ({"logprobs": 4}, 10),  # the output's alone: 2 x 5
    ],
)
def test_the_logprob_entries_of_a_request_are_bounded(tiny_app, monkeypatch, body, fits_n):
    """Every choice's scored tokens x (alternatives + 1), prompt and output together, at most
    MAX_LOGPROB_ENTRIES a request (each entry is held until the response is written): one
    choice more than fits is a 400 saying so, before anything is queued."""
    from toppings.server.api.openai import choices

    monkeypatch.setattr(choices, "MAX_LOGPROB_ENTRIES", 100)
    http, _ = tiny_app
    body = {"prompt": PROMPT, "max_tokens": 2, **GREEDY, **body}
    fits = post_json(http, "/v1/completions", {**body, "n": fits_n})
    assert len(fits["choices"]) == fits_n
    refused = http.post("/v1/completions", json={**body, "n": fits_n + 1})
    assert refused.status_code == 400
    assert "this server answers at most 100 a request" in refused.get_json()["error"]["message"]


def test_the_logprob_entries_in_flight_are_bounded_and_given_back(tiny_app, monkeypatch):
    """What the answers in flight hold together is charged to one budget: while a stream holds
    most of it, a request whose logprobs pass it is a 429 with Retry-After and one without
    logprobs is served; every answer gives its charge back when it ends, streamed or not."""
    from prometheus_client.parser import text_string_to_metric_families

    http, _ = tiny_app
    state = http.application.extensions["toppings"]
    monkeypatch.setattr(state.logprobs, "max_in_flight", 60)
    rejected_before = state.logprobs.num_rejected

    def series() -> dict[str, float]:
        text = http.get("/metrics").get_data(as_text=True)
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if "logprob" in s.name}  # fmt: skip

    body = {"prompt": PROMPT, **GREEDY}
    stream = http.post(
        "/v1/completions",
        json={**body, "max_tokens": 10, "logprobs": 4, "stream": True},
        buffered=False,
    )  # 10 output tokens x 5 entries, held until the stream closes
    assert stream.status_code == 200 and state.logprobs.num_in_flight == 50
    asks = {**body, "max_tokens": 3, "logprobs": 4}  # 15 more: past 60
    refused = http.post("/v1/completions", json=asks)
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    assert "logprob entries" in refused.get_json()["error"]["message"]
    assert series() == {
        "toppings:logprob_entries_in_flight": 50,
        "toppings:max_logprob_entries_in_flight": 60,
        "toppings:logprob_requests_rejected_total": rejected_before + 1,
    }
    assert len(post_json(http, "/v1/completions", {**body, "max_tokens": 3})["choices"]) == 1
    assert b"[DONE]" in b"".join(stream.response)
    stream.close()
    assert state.logprobs.num_in_flight == 0
    assert post_json(http, "/v1/completions", asks)["choices"][0]["logprobs"] is not None
    assert state.logprobs.num_in_flight == 0
