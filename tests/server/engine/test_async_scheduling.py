"""Async scheduling (server/engine/step_pipeline.py): the same outputs as the synchronous loop on
any mix of requests, the next step planned while the device runs this one, nothing held after.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers import assert_memory_balanced, running_engine
from toppings.server.requests.request import (
    Constraint,
    ConstraintKind,
    GenerationRequest,
    SamplingParams,
)


def workload(engine) -> list[tuple[float, GenerationRequest]]:
    """(delay before submitting, request): greedy and seeded sampling, lengths from 1 token,
    EOS honoured, logprobs, prompt logprobs, a stop string, an adapter, arrivals while others
    decode."""
    adapter, eos = engine.resolve_adapter("a"), min(engine.eos_ids)
    items = []
    for i in range(14):
        params = SamplingParams(
            max_new_tokens=[1, 2, 3, 7, 16, 24][i % 6],
            temperature=0.0 if i % 3 else 0.9,
            seed=i,
            ignore_eos=i % 4 == 0,
            logprobs=2 if i % 5 == 0 else None,
            prompt_logprobs=1 if i == 7 else None,
            stop=("e",) if i == 9 else (),
            # two requests stop at EOS after 2 tokens, while their neighbours decode on
            min_tokens=2 if i in (3, 11) else 0,
            logit_bias=((eos, 100.0),) if i in (3, 11) else (),
        )
        prompt = [3 + (i * 7 + j) % 150 for j in range(4 + i % 9 + (50 if i % 4 == 1 else 0))]
        items.append(
            (0.0 if i < 6 else 0.01, GenerationRequest(prompt, params, adapter if i % 2 else None))
        )
    return items


def run_workload(model_dir, adapters, async_scheduling: bool, **config) -> list[tuple]:
    with running_engine(model_dir, adapters, max_total_tokens=4096, max_batch_size=8,
                        async_scheduling=async_scheduling, **config) as engine:  # fmt: skip
        handles = []
        for delay, request in workload(engine):
            time.sleep(delay)
            handles.append(engine.submit(request))
        outputs = []
        for handle in handles:
            events = list(handle.events(timeout_s=120))
            last = events[-1]
            ids = [t for e in events for t in e.new_token_ids]
            text = "".join(e.new_text for e in events)
            logprobs = [
                (lp.token_id, round(lp.logprob, 4)) for e in events for lp in e.logprobs or []
            ]
            prompt_lps = [e.prompt_logprobs for e in events if e.prompt_logprobs]
            outputs.append((ids, text, last.finish_reason, logprobs, len(prompt_lps)))
        assert_memory_balanced(engine)
        assert engine.adapter_refs.in_flight(engine.resolve_adapter("a")) == 0
    return outputs


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompts", "chunked-32"])
def test_async_scheduling_gives_the_synchronous_loops_outputs(tiny_model_dir, tmp_path, chunked):
    """Prompts of up to 62 tokens, in chunks of a 32-token step budget or whole."""
    from toppings.scripts.make_adapters import make_random_adapter

    adapters = {"a": str(make_random_adapter(tmp_path / "a", tiny_model_dir, rank=8, seed=3))}
    config = {"chunked_prefill": chunked, "max_num_batched_tokens": 32 if chunked else 0}
    sync = run_workload(tiny_model_dir, adapters, async_scheduling=False, **config)
    ahead = run_workload(tiny_model_dir, adapters, async_scheduling=True, **config)
    assert ahead == sync
    reasons = {out[2] for out in sync}
    assert {"length", "stop"} <= reasons  # requests ended on several paths, mid-batch


def planned_during_forward(model_dir, async_scheduling: bool) -> int:
    """How many times the scheduler planned a step while one was on a stand-in device (a
    forward that sleeps without the GIL and returns zero logits): launched and not yet back."""
    with running_engine(model_dir, max_total_tokens=2048,
                        async_scheduling=async_scheduling) as engine:  # fmt: skip
        overlaps = []
        vocab = engine.model_config.vocab_size
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def forward(batch, kv):
            time.sleep(0.02)
            rows = len(batch.seg_starts) - 1 if batch.logit_rows is None else len(batch.logit_rows)
            return torch.zeros(rows, vocab), None

        def spied_schedule():
            overlaps.append(scheduler.has_steps_on_device)
            return schedule()

        engine.model.forward = forward
        scheduler.schedule = spied_schedule
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        handles = [engine.submit(GenerationRequest([5, 6, 7], params)) for _ in range(4)]
        results = [h.result(timeout_s=120) for h in handles]
        assert all(len(r.new_token_ids) == 8 for r in results)
        assert_memory_balanced(engine)
    return sum(overlaps)


def test_the_next_step_is_planned_while_the_device_runs(tiny_model_dir):
    """With async scheduling the scheduler plans a step while the one before is on the device;
    the synchronous loop never does."""
    assert planned_during_forward(tiny_model_dir, async_scheduling=False) == 0
    # the prefill step is taken back before the next plan; then each decode step is planned
    # while the one before runs, the last two ending the requests
    assert planned_during_forward(tiny_model_dir, async_scheduling=True) >= 6


def test_constrained_and_free_requests_side_by_side(smollm2_dir):
    """A grammar advances on each sampled token: a constrained request's steps are not planned
    ahead, and its neighbours' outputs are the synchronous loop's."""
    outputs = {}
    for async_scheduling in (False, True):
        with running_engine(smollm2_dir, max_total_tokens=4096,
                            async_scheduling=async_scheduling) as engine:  # fmt: skip
            regex = Constraint(ConstraintKind.REGEX, "[a-c]{3,6}")
            requests = [
                GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=12, temperature=0.0)),
                GenerationRequest(
                    [4, 5, 6], SamplingParams(max_new_tokens=12, temperature=0.0, constraint=regex)
                ),  # fmt: skip
                GenerationRequest([7, 8, 9], SamplingParams(max_new_tokens=9, temperature=0.0)),
            ]
            handles = [engine.submit(r) for r in requests]
            outputs[async_scheduling] = [h.result(timeout_s=120).new_text for h in handles]
            assert_memory_balanced(engine)
    assert outputs[True] == outputs[False]
    assert 3 <= len(outputs[True][1]) <= 6 and set(outputs[True][1]) <= set("abc")
