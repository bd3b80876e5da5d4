"""A constraint the grammar engine cannot satisfy is never answered as success (issue 48).

What the engine can tell at compile time (an empty language, a limit passed at the first step)
is a 400 naming the field, before anything is queued; a matcher that fails while generating
ends that choice with a 422 `constraint_failed` error (an error event when streamed), never
finish_reason "stop", and is counted in /metrics."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from tests.helpers import running_engine
from toppings.server.api.app import create_app
from toppings.server.sampling import grammar

pytestmark = pytest.mark.slow  # llguidance needs a real tokenizer: SmolLM2's

CHAT = [{"role": "user", "content": "hi"}]
SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
# Every value nests without end: llguidance takes `{"a": ` and would run to max_tokens.
ENDLESS_JSON = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
# The schema of issue 67 as the probe sent it: without "type", any value that is not an object
# satisfies it (null, "x", 1), so "stop" is an honest end.
UNTYPED = {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}
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
        ({"guided_json": ENDLESS_JSON}, "'guided_json'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": ENDLESS_JSON}}}, "'response_format.json_schema.schema'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ENDLESS_JSON}}],
          "tool_choice": "required"}, "'tools'"),
    ],
    ids=["guided_json", "json_schema", "gbnf", "lark", "endless_guided_json",
         "endless_json_schema", "endless_tool"],
)  # fmt: skip
def test_an_empty_language_is_a_400_at_compile_time(client, fields, named):
    body = {"messages": CHAT, "max_tokens": 8, **fields}
    error = _error(client.post("/v1/chat/completions", json=body), 400)
    assert named in error["message"] and "no output that satisfies it" in error["message"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_stop_only_ends_output_that_satisfies_the_schema(client, endpoint, field):
    """The probe's request (max_tokens 24): "stop" only on output the schema accepts under the
    `jsonschema` package, "length" on a prefix the token limit cut."""
    if field == "guided_json":
        fields = {"guided_json": UNTYPED}
    else:
        fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                  "schema": UNTYPED}}}  # fmt: skip
    body = {"max_tokens": 24, "temperature": 0, **fields}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Write a JSON value."}]
    else:
        body["prompt"] = "A JSON value:"
    answer = client.post(f"/v1/{endpoint.replace('chat', 'chat/completions')}", json=body)
    assert answer.status_code == 200, answer.get_data()[:400]
    reply = answer.get_json()
    choice = reply["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(text), UNTYPED)
    else:
        assert choice["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == 24


def test_a_regex_past_the_engines_limits_is_a_400(client, monkeypatch):
    # A regex that needs more lexer work at its first step than the limits allow (lowered
    # here so that a short regex passes them; before, it was a 200 with "" and "stop").
    limits = llguidance.LLParserLimits(step_lexer_fuel=10)
    monkeypatch.setattr(grammar, "LIMITS", limits)
    body = {"prompt": "hi", "max_tokens": 8, "guided_regex": "[a-z]{1,40}(,[a-z]{1,40})*"}
    error = _error(client.post("/v1/completions", json=body), 400)
    assert "'guided_regex' (regex)" in error["message"]


def test_a_regex_whose_first_step_uses_up_the_lexer_is_a_400(client):
    # (a{1000}){1000}: the first mask builds so many expressions (shared by every copy of the
    # grammar) that the next copy's first mask fails at once: it was a 422 mid-request.
    body = {"prompt": "hi", "max_tokens": 8, "guided_regex": "(a{1000}){1000}"}
    error = _error(client.post("/v1/completions", json=body), 400)
    assert "'guided_regex'" in error["message"] and "too many expressions" in error["message"]


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
