"""Structured output in the engine on SmolLM2: constrained and free requests of several adapters
in one batch, 50 JSON schemas of varied features, grammar ends and max_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tests.helpers import running_engine
from toppings.server.requests.request import (
    Constraint,
    ConstraintKind,
    GenerationRequest,
    RequestError,
    RequestHandle,
    SamplingParams,
)
from toppings.server.requests.sequence import Sequence
from toppings.server.sampling.sampler import Sampler

pytestmark = pytest.mark.slow
ADAPTERS = ("a0", "a1", "a2", "a3")


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_dir):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("structured_adapters")
    loras = {
        name: str(make_random_adapter(root / name, smollm2_dir, rank=4 + 4 * i, seed=i))
        for i, name in enumerate(ADAPTERS)
    }
    with running_engine(smollm2_dir, loras, max_total_tokens=32768) as eng:
        yield eng


def schema_set() -> list[dict]:
    """50 JSON schemas: nested objects, arrays, enums, numbers with ranges, strings with a
    length or a pattern, booleans, required and optional properties."""
    leaves = [
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": -5, "maximum": 40},
        # A number's fraction bounded by multipleOf: with an unbounded one a 135M model may
        # write digits until max_tokens (which then ends it, "length").
        {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25},
        {"enum": ["red", "green", "blue"]},
        {"type": "boolean"},
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 1,
            "maxItems": 3,
        },
        {"type": "string", "pattern": "^[a-z]{2,6}$"},
    ]
    schemas = []
    for i in range(50):
        props = {f"field{j}": leaves[(i + 3 * j) % len(leaves)] for j in range(1 + i % 4)}
        required = [k for j, k in enumerate(props) if (i + j) % 3 != 1] or [next(iter(props))]
        schema = {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
        if i % 5 == 0:
            schema = {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                               "inner": schema},
                "required": ["id", "inner"],
                "additionalProperties": False,
            }  # fmt: skip
        if i % 7 == 3:
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 2}
        schemas.append(schema)
    return schemas


def chat_ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(rendered, add_special_tokens=False))


def json_request(engine, schema: dict, adapter: str | None, **params) -> GenerationRequest:
    ids = chat_ids(engine, f"Reply with JSON for this schema: {json.dumps(schema)}")
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    params = dict(dict(max_new_tokens=200, temperature=0), **params)
    ref = engine.resolve_adapter(adapter)
    return GenerationRequest(ids, SamplingParams(constraint=constraint, **params), ref)


def free_requests(engine) -> list[GenerationRequest]:
    """16 free requests over the adapters and the base: greedy and seeded sampled."""
    reqs = []
    for i in range(16):
        ids = chat_ids(engine, f"Tell me fact number {i} about the sea.")
        params = SamplingParams(max_new_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i)
        adapter = None if i % 5 == 4 else ADAPTERS[i % 4]
        reqs.append(GenerationRequest(ids, params, engine.resolve_adapter(adapter)))
    return reqs


def results(engine, reqs: list[GenerationRequest]):
    return [h.result(timeout_s=600) for h in engine.submit_all(reqs)]


def test_mixed_batch_constrained_valid_and_free_unchanged(engine):
    schemas = schema_set()[:16]
    constrained = [
        json_request(engine, s, ADAPTERS[i % 4] if i % 3 else None, temperature=0.7 * (i % 2),
                     seed=i)
        for i, s in enumerate(schemas)
    ]  # fmt: skip
    alone = results(engine, free_requests(engine))
    mixed = results(engine, [r for pair in zip(free_requests(engine), constrained) for r in pair])
    for schema, out in zip(schemas, mixed[1::2]):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.new_text), schema)
    for solo, together in zip(alone, mixed[0::2]):
        assert together.new_token_ids == solo.new_token_ids


def test_fifty_schemas_all_valid(engine):
    schemas = schema_set()
    outs = results(engine, [json_request(engine, s, ADAPTERS[i % 4] if i % 2 else None)
                            for i, s in enumerate(schemas)])  # fmt: skip
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.new_text)
        jsonschema.validate(json.loads(out.new_text), schema)


def test_grammar_end_stops_without_eos_and_length_when_max_tokens_first(engine):
    ids = chat_ids(engine, "Is the sea blue?")
    choice = Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "no", "maybe not"]))
    regex = Constraint(ConstraintKind.REGEX, r"\d{3}-\d{4}")
    long_json = Constraint(
        ConstraintKind.JSON_SCHEMA,
        json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 50}),
    )
    outs = results(engine, [
        GenerationRequest(ids, SamplingParams(max_new_tokens=20, temperature=0, constraint=choice)),
        GenerationRequest(ids, SamplingParams(max_new_tokens=20, temperature=0, constraint=regex)),
        GenerationRequest(ids, SamplingParams(max_new_tokens=8, temperature=0,
                                              constraint=long_json)),
    ])  # fmt: skip
    assert outs[0].new_text in ("yes", "no", "maybe not") and outs[0].finish_reason == "stop"
    assert not set(outs[0].new_token_ids) & engine.eos_ids  # it ended at the grammar's end
    assert len(outs[1].new_text) == 8 and outs[1].new_text[3] == "-"
    assert outs[1].new_text.replace("-", "").isascii() and outs[1].finish_reason == "stop"
    assert outs[2].finish_reason == "length" and len(outs[2].new_token_ids) == 8


@pytest.mark.parametrize(
    "kind, spec, words",
    [
        (ConstraintKind.JSON_SCHEMA, '{"type": "objekt"}', "objekt"),
        (ConstraintKind.JSON_SCHEMA, '{"type": "array", "uniqueItems": true}', "uniqueItems"),
        (ConstraintKind.JSON_SCHEMA, '{"not": {"type": "string"}}', "not"),
        (ConstraintKind.JSON_SCHEMA, "[1, 2", "json_schema"),
        (ConstraintKind.REGEX, "(abc", "regex"),
        (ConstraintKind.GRAMMAR, "root ::= missing_rule", "grammar"),
    ],
)
def test_bad_constraint_refused_before_queueing(engine, kind, spec, words):
    ids = chat_ids(engine, "hi")
    request = GenerationRequest(ids, SamplingParams(constraint=Constraint(kind, spec)))
    waiting = len(engine.queue)
    with pytest.raises(RequestError) as err:
        engine.submit(request)
    assert err.value.code == 400 and words in str(err.value)
    assert len(engine.queue) == waiting


def test_huge_constraint_refused():
    with pytest.raises(RequestError, match="at most"):
        Constraint(ConstraintKind.GRAMMAR, 'root ::= "' + "a" * 200_000 + '"')


def test_compiled_once_per_text(engine):
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    before = engine.grammars.num_compiled
    outs = results(
        engine, [json_request(engine, schema, None, max_new_tokens=30) for _ in range(3)]
    )
    assert engine.grammars.num_compiled == before + 1
    assert all(json.loads(o.new_text)["k"] is not None for o in outs)


def test_a_resumed_request_goes_on_in_its_grammar(engine):
    """A preempted or squashed request resumes after the tokens it made: its grammar matcher
    goes on from them, and the whole output is the one it makes without the pause."""
    sampler = Sampler(engine.eos_ids, engine.grammars)
    constraint = Constraint(ConstraintKind.CHOICE, json.dumps(["alpha beta", "gamma"]))
    logits = torch.randn(
        1, engine.model_config.vocab_size, generator=torch.Generator().manual_seed(0)
    )

    def run(resume_after: int | None) -> list[int]:
        params = SamplingParams(max_new_tokens=16, temperature=0, constraint=constraint)
        req = GenerationRequest([1, 2, 3], params)
        seq = Sequence(req, RequestHandle(req, lambda _: None), engine.tokenizer, 0.0)
        for step in range(32):
            if step == resume_after:
                seq.resume()
            token = sampler.sample([seq], logits).tokens[0]
            if seq.append(token, engine.eos_ids, 10**6) is not None:
                return seq.output_ids
        raise AssertionError("the grammar never ended the request")

    once = run(None)
    assert engine.tokenizer.decode(once) in ("alpha beta", "gamma")
    assert run(resume_after=1) == once
