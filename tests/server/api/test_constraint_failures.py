"""A constraint the grammar engine cannot satisfy is never answered as success (issue 48).

What the engine can tell at compile time (an empty language, a limit passed at the first step)
is a 400 naming the field, before anything is queued; a matcher that fails while generating
ends that choice with a 422 `constraint_failed` error (an error event when streamed), never
finish_reason "stop", and is counted in /metrics."""

from __future__ import annotations

import json

import llguidance
import pytest

from tests.helpers import running_engine
from toppings.server.api.app import create_app
from toppings.server.engine import grammar

pytestmark = pytest.mark.slow  # llguidance needs a real tokenizer: SmolLM2's

CHAT = [{"role": "user", "content": "hi"}]
SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
# Each token must be "a" and the language has no end: llguidance fails on the first token.
ENDLESS = 'root ::= "a" root'


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    with running_engine(smollm2_dir, {}, max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    return create_app(engine).test_client()


def _error(answer, code: int) -> dict:
    assert answer.status_code == code, answer.get_data()[:400]
    return answer.get_json()["error"]


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"guided_json": SELF_REF}, "'guided_json'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": SELF_REF}}}, "'response_format.json_schema.schema'"),
        ({"guided_grammar": "root ::= root"}, "'guided_grammar'"),
        ({"guided_grammar": "start: start"}, "'guided_grammar'"),
    ],
    ids=["guided_json", "json_schema", "gbnf", "lark"],
)  # fmt: skip
def test_an_empty_language_is_a_400_at_compile_time(client, fields, named):
    body = {"messages": CHAT, "max_tokens": 8, **fields}
    error = _error(client.post("/v1/chat/completions", json=body), 400)
    assert named in error["message"] and "no output that satisfies it" in error["message"]


def test_a_regex_past_the_engines_limits_is_a_400(client, monkeypatch):
    # A regex that needs more lexer work at its first step than the limits allow (lowered
    # here so that a short regex passes them; before, it was a 200 with "" and "stop").
    limits = llguidance.LLParserLimits(step_lexer_fuel=10)
    monkeypatch.setattr(grammar, "LIMITS", limits)
    body = {"prompt": "hi", "max_tokens": 8, "guided_regex": "[a-z]{1,40}(,[a-z]{1,40})*"}
    error = _error(client.post("/v1/completions", json=body), 400)
    assert "'guided_regex' (regex)" in error["message"]


def test_a_matcher_failure_is_an_error_never_stop(client):
    before = _failures(client)
    body = {"prompt": "hi", "max_tokens": 8, "guided_grammar": ENDLESS}
    error = _error(client.post("/v1/completions", json=body), 422)
    assert error["type"] == "constraint_failed" and "'guided_grammar'" in error["message"]

    answer = client.post("/v1/completions", json=dict(body, stream=True))
    assert answer.status_code == 200
    events = [line[6:] for line in answer.get_data(as_text=True).splitlines() if line]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == 422 and last["error"]["type"] == "constraint_failed"
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert "stop" not in finishes
    assert _failures(client) == before + 2
    # the server keeps serving, constraints included
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                               "guided_regex": "[a-z]{1,3}"})  # fmt: skip
    assert ok.status_code == 200 and ok.get_json()["choices"][0]["finish_reason"] == "stop"


def _failures(client) -> float:
    text = client.get("/metrics").get_data(as_text=True)
    line = next(x for x in text.splitlines() if x.startswith("toppings:constraint_failures"))
    return float(line.split()[-1])
