"""The output processor (server/engine/output_processor.py): detokenizing, stop strings and
streaming on a thread of their own give the outputs the engine thread gave, end a request that
hit a stop string in the engine (its KV given back), and stop with the engine."""

from __future__ import annotations

import time

import pytest

from tests.helpers import assert_memory_balanced, running_engine, wait_steps_back
from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.requests.sequence import Sequence
from toppings.server.requests.text_output import OutputRecord, TextOutput

PROMPT = [40, 41, 42]


def params(**fields) -> SamplingParams:
    return SamplingParams(
        **{"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True, **fields}
    )


def outputs_of(engine, prompt, sampling):
    """Every output of one request, without its timings."""
    handle = engine.submit(GenerationRequest(list(prompt), sampling))
    return [
        (
            o.new_token_ids,
            o.new_text,
            o.finish_reason,
            o.output_tokens,
            None if o.logprobs is None else [(lp.token_id, lp.logprob) for lp in o.logprobs],
        )
        for o in handle.events(timeout_s=120)
    ]


def mid_token_stop(engine) -> str:
    """Two characters of the greedy text that start inside a token's text, not at its start."""
    outs = outputs_of(engine, PROMPT, params())
    pieces = [text for _, text, *_ in outs]
    text = "".join(pieces)
    start = 0
    for piece in pieces:
        for i in range(start + 1, start + len(piece)):
            stop = text[i : i + 2]
            if len(stop) == 2 and stop.strip() and text.find(stop) == i:
                return stop
        start += len(piece)
    pytest.skip(f"no stop string starting inside a token in {text!r}")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_outputs_equal_the_engine_thread_path(tiny_model_dir, async_scheduling):
    """The same outputs, one by one (token ids, text, finish, counts, logprobs), with the output
    thread as on the engine thread: greedy runs to length, a stop string that starts inside a
    token, logprobs, and streamed chunks that add up to the final text."""
    runs = {}
    for thread in (False, True):
        with running_engine(
            tiny_model_dir,
            max_total_tokens=2048,
            output_thread=thread,
            async_scheduling=async_scheduling,
        ) as engine:
            assert (engine.outputs is not None) == thread
            stop = mid_token_stop(engine)
            runs[thread] = [
                outputs_of(engine, PROMPT, sampling)
                for sampling in (
                    params(),
                    params(stop=(stop,)),
                    params(stop=(stop,), logprobs=2),
                    params(max_new_tokens=6, logprobs=0),
                )
            ]
            assert_memory_balanced(engine)
    assert runs[True] == runs[False]
    full, cut, cut_logprobs, _ = runs[True]
    full_text = "".join(text for _, text, *_ in full)
    cut_text = "".join(text for _, text, *_ in cut)
    assert cut[-1][2] == "stop" and full[-1][2] == "length"
    assert cut_text == full_text[: full_text.find(stop)] and cut_text != full_text
    ids = [t for chunk in cut for t in chunk[0]]
    assert cut[-1][3] == len(ids) < 24  # usage counts end at the token that completed the stop
    assert ids == [t for chunk in full for t in chunk[0]][: len(ids)]
    assert sum(len(chunk[4]) for chunk in cut_logprobs) == len(ids)


def test_a_stop_string_ends_the_request_in_the_engine(tiny_model_dir):
    """The processor finds the stop string after the engine moved on; the engine then ends the
    request ("stop", not run to its length) and gives its KV back."""
    with running_engine(tiny_model_dir, max_total_tokens=2048, output_thread=True) as engine:
        stop = mid_token_stop(engine)
        wait_steps_back(engine)
        free_before = engine.stats().to_json()["free_kv_tokens"]
        finished_before = dict(engine.scheduler.finished)
        outs = outputs_of(engine, PROMPT, params(max_new_tokens=400, stop=(stop,)))
        assert outs[-1][2] == "stop" and [o[2] for o in outs[:-1]] == [None] * (len(outs) - 1)
        ended = {
            reason: n - finished_before.get(reason, 0)
            for reason, n in engine.scheduler.finished.items()
        }
        assert ended == {**{r: 0 for r in finished_before}, "stop": 1}
        wait_steps_back(engine)
        assert engine.stats().to_json()["free_kv_tokens"] == free_before
        assert_memory_balanced(engine)


def test_a_stop_found_after_the_length_end_counts_as_stop(tiny_model_dir):
    """The stop string completes at the last token a request may make: the engine ends it by
    its length before the processor finds the stop. The client sees "stop", and so does the
    count of finished requests (/metrics), not "length"."""
    with running_engine(tiny_model_dir, max_total_tokens=2048, output_thread=True) as engine:
        stop = mid_token_stop(engine)
        full = outputs_of(engine, PROMPT, params())
        end = "".join(text for _, text, *_ in full).find(stop) + len(stop)
        text, num_tokens = "", 0
        for ids, piece, *_ in full:  # the tokens up to the one that completes the stop
            text, num_tokens = text + piece, num_tokens + len(ids)
            if len(text) >= end:
                break
        wait_steps_back(engine)
        before = dict(engine.scheduler.finished)
        outs = outputs_of(engine, PROMPT, params(max_new_tokens=num_tokens, stop=(stop,)))
        assert outs[-1][2] == "stop" and outs[-1][3] == num_tokens
        deadline = time.monotonic() + 30
        while True:  # the processor's end comes after the engine's
            ended = {r: n - before.get(r, 0) for r, n in engine.scheduler.finished.items()}
            if ended.get("stop") == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert {r: n for r, n in ended.items() if n} == {"stop": 1}
        assert_memory_balanced(engine)


def test_shutdown_ends_every_request_once_and_joins_the_thread(tiny_model_dir):
    with running_engine(tiny_model_dir, max_total_tokens=2048, output_thread=True) as engine:
        thread = engine.outputs
        handle = engine.submit(GenerationRequest([1] * 10, params(max_new_tokens=500)))
        events = handle.events(timeout_s=120)
        assert next(events).finish_reason is None
    assert not thread.is_alive
    reasons = [o.finish_reason for o in events]
    assert reasons[-1] == "abort" and reasons.count("abort") == 1
    assert handle.poll() == []


def test_a_request_whose_text_fails_ends_with_an_error_once(tiny_model_dir, monkeypatch):
    """A fault in a request's text on the output thread ends that request (one final output,
    "error"), and the engine ends it too (its KV given back)."""
    from toppings.server.requests import detokenize

    def push(self, token_id):
        raise RuntimeError("undecodable")

    with running_engine(tiny_model_dir, max_total_tokens=2048, output_thread=True) as engine:
        finished_before = engine.scheduler.finished.get("error", 0)
        monkeypatch.setattr(detokenize.TextStream, "push", push)
        handle = engine.submit(GenerationRequest(list(PROMPT), params(max_new_tokens=400)))
        outs = list(handle.events(timeout_s=120))
        assert [o.finish_reason for o in outs] == ["error"]
        assert "undecodable" in outs[0].error
        wait_steps_back(engine)
        deadline = time.monotonic() + 30
        while engine.scheduler.has_work():  # ended a step or a few later
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.scheduler.finished.get("error", 0) == finished_before + 1
        assert_memory_balanced(engine)
    assert handle.poll() == []


def test_the_thread_is_on_by_default_only_where_the_engine_waits_on_a_device():
    """On where the engine thread waits on the device inside each step (cuda, synchronous
    loop); elsewhere the threads would only take turns at the interpreter (docs/benchmarks.md,
    the output processor's entry)."""
    assert not EngineConfig().use_output_thread
    assert EngineConfig(device="cuda", async_scheduling=False).use_output_thread
    assert not EngineConfig(device="cuda").use_output_thread  # async scheduling on
    assert EngineConfig(output_thread=True).use_output_thread


class Handle:
    def __init__(self):
        self.outputs = []

    def put(self, output):
        self.outputs.append(output)


def text_side(tokenizer, stop: str):
    request = GenerationRequest([1, 2], params(stop=(stop,)))
    handle = Handle()
    seq = Sequence(request, handle, tokenizer, 0.0, outputs=None)
    return seq, TextOutput(request, handle, tokenizer, 0.0), handle


def test_records_past_a_stop_are_dropped_and_its_finish_wins(tiny_model_dir):
    """What the engine makes after the stop (more tokens, a finish of its own) changes nothing
    the client sees: the text is cut, the ids and counts end at the stop's token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode("hello world, and more", add_special_tokens=False)
    stop = "world"
    seq, output, handle = text_side(tokenizer, stop)
    hit_at = None
    for i, token in enumerate(ids):
        if output.apply(OutputRecord(seq, output, token)):
            hit_at = i
            assert output.stopped
    assert hit_at is not None and hit_at < len(ids) - 1
    output.apply(OutputRecord(seq, output, finish="length"))
    output.apply(OutputRecord(seq, output, finish="abort"))  # once: dropped
    final = handle.outputs[-1]
    assert [o.finish_reason for o in handle.outputs].count("stop") == 1
    assert final.finish_reason == "stop" and final.output_tokens == hit_at + 1
    sent_ids = [t for o in handle.outputs for t in o.new_token_ids]
    assert sent_ids == ids[: hit_at + 1]
    text = "".join(o.new_text for o in handle.outputs)
    assert text == tokenizer.decode(ids[: hit_at + 1]).split(stop)[0]


def test_a_grammar_failure_on_the_stop_token_wins(tiny_model_dir):
    """As on the engine thread: the token that fails its grammar ends the request with the
    error (422) even where its text completes a stop string."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    seq, output, handle = text_side(tokenizer, "world")
    for token in ids[:-1]:
        assert not output.apply(OutputRecord(seq, output, token))
    assert not output.apply(OutputRecord(seq, output, ids[-1], ends="error"))
    output.apply(OutputRecord(seq, output, finish="error", error="bad", error_code=422))
    assert handle.outputs[-1].finish_reason == "error"
    assert handle.outputs[-1].error_code == 422
