"""vLLM's `allowed_token_ids`: a request samples only the tokens it names (every other token's
logit masked before sampling, greedy or not; the logprobs stay the model's raw ones), and bad
values are a 400 naming the field."""

from __future__ import annotations

import pytest

from tests.helpers import post_json

PROMPT = [5, 9, 14, 3, 22, 7]
GREEDY = {"temperature": 0, "ignore_eos": True}


def test_only_the_allowed_tokens_are_sampled(tiny_app):
    http, tokenizer = tiny_app
    body = {"input_ids": PROMPT, "max_new_tokens": 12, **GREEDY}
    free = post_json(http, "/generate", body)["token_ids"]
    allowed = [t for t in range(40, 60) if t not in free][:3]  # none of the free run's choices
    greedy = post_json(http, "/generate", {**body, "allowed_token_ids": allowed})["token_ids"]
    assert len(greedy) == 12 and set(greedy) <= set(allowed)
    sampled = {**body, "temperature": 1.0, "seed": 3, "allowed_token_ids": allowed}
    assert set(post_json(http, "/generate", sampled)["token_ids"]) <= set(allowed)
    # the OpenAI route: the same tokens; its logprobs are the raw model's, where the free run's
    # first token is still the most likely one
    completion = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 1, **GREEDY,
                  "allowed_token_ids": allowed}  # fmt: skip
    choice = post_json(http, "/v1/completions", completion)["choices"][0]
    assert choice["text"] == tokenizer.decode(greedy, skip_special_tokens=True)
    first = choice["logprobs"]["top_logprobs"][0]  # the chosen token's and the most likely's
    assert set(first) == {tokenizer.decode([greedy[0]]), tokenizer.decode([free[0]])}


@pytest.mark.parametrize(
    "value, words",
    [
        ([], "'allowed_token_ids' must hold at least one token id"),
        (7, "'allowed_token_ids' must be a list of token ids"),
        ([-1], "'allowed_token_ids' must be a list of token ids"),
        ([10**9], "'allowed_token_ids' must be in [0, "),
    ],
    ids=["empty", "not a list", "negative", "past the vocabulary"],
)
def test_bad_allowed_token_ids_are_a_400(tiny_app, value, words):
    http, _ = tiny_app
    body = {"prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": value}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 400 and words in answer.get_json()["error"]["message"]


def test_a_request_holds_at_most_4096_allowed_ids():
    from toppings.server.requests.request import RequestError, SamplingParams

    SamplingParams(allowed_token_ids=tuple(range(4096)))
    with pytest.raises(RequestError, match="at most 4096 ids"):
        SamplingParams(allowed_token_ids=tuple(range(4097)))
