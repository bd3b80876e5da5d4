"""bench_chunked_prefill's pure parts on no model: inter-token gaps from output times, the SLO
knee, the long prompts mixed into a trace, the output clock on a bare handle, and the burst
capacity rule it takes from bench_queueing."""

from __future__ import annotations

import pytest

from bench.bench_chunked_prefill import (
    OutputClock,
    mix_long_prompts,
    slo_knee,
    token_gaps,
    ttft_floor,
)
from bench.bench_queueing import burst_capacity
from toppings.scripts.loadgen.workload import LengthSpec, TraceEntry
from toppings.server.requests.request import (
    GenerationRequest,
    RequestHandle,
    RequestOutput,
    SamplingParams,
)


def test_one_token_per_output_gives_the_gaps_between_outputs():
    assert token_gaps([1.0, 1.5, 2.5, 2.75], [1, 1, 1, 1]) == [0.5, 1.0, 0.25]


def test_an_output_of_k_tokens_counts_as_k_equal_gaps():
    assert token_gaps([0.0, 0.3, 1.5], [1, 3, 2]) == pytest.approx([0.1, 0.1, 0.1, 0.6, 0.6])


def test_outputs_without_tokens_are_skipped_and_the_first_output_has_no_gap():
    # The first output's two tokens are TTFT's; the empty final output adds nothing.
    assert token_gaps([0.0, 0.5, 1.0, 9.0], [2, 0, 1, 0]) == [1.0]
    assert token_gaps([0.2], [4]) == []
    assert token_gaps([], []) == []


def test_knee_is_the_highest_load_within_the_slo():
    assert slo_knee([100.0, 400.0, 900.0], 500.0) == (1, True)
    assert slo_knee([100.0, 600.0, 450.0], 500.0) == (2, True)  # within again at a higher load
    assert slo_knee([100.0, 200.0], 200.0) == (1, True)  # the SLO itself is within


def test_knee_falls_back_to_the_lowest_load_when_none_is_within():
    assert slo_knee([700.0, 900.0], 500.0) == (0, False)


def _trace(num: int) -> list[TraceEntry]:
    return [TraceEntry(i, 0.1 * i, f"r8-{i % 2}", 8, [100 + i] * 10, 5) for i in range(num)]


def test_long_prompts_replace_a_share_of_the_prompts_only():
    trace = _trace(40)
    mixed = mix_long_prompts(trace, 0.1, LengthSpec.parse("uniform:200:300", 1 << 30), seed=3)
    changed = [i for i, (a, b) in enumerate(zip(trace, mixed)) if a != b]
    assert len(changed) == 4
    for i in changed:
        assert 200 <= len(mixed[i].prompt) <= 300
        assert all(100 <= t < 250 for t in mixed[i].prompt)
        old, new = trace[i], mixed[i]
        assert (old.idx, old.arrival_s, old.model, old.rank, old.max_tokens) == (
            new.idx, new.arrival_s, new.model, new.rank, new.max_tokens,
        )  # fmt: skip
    assert mix_long_prompts(trace, 0.1, LengthSpec.parse("250", 1 << 30), seed=3) != mixed
    again = mix_long_prompts(trace, 0.1, LengthSpec.parse("uniform:200:300", 1 << 30), seed=3)
    assert again == mixed


def test_a_small_trace_gets_at_least_one_long_prompt_and_share_zero_none():
    trace = _trace(3)
    spec = LengthSpec.parse("64", 1 << 30)
    assert sum(len(e.prompt) == 64 for e in mix_long_prompts(trace, 0.1, spec, seed=0)) == 1
    assert mix_long_prompts(trace, 0.0, spec, seed=0) == trace


def test_output_clock_times_each_put_and_gives_the_gaps():
    request = GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=3))
    handle = RequestHandle(request, abort_fn=lambda _: None)
    clock = OutputClock(handle)
    for ids, text, reason in (([7], "", None), ([8, 9], "ab", None), ([], "", "length")):
        handle.put(RequestOutput(request.request_id, ids, text, finish_reason=reason))
    final, gaps, untimed, to_text = clock.finish(timeout_s=1.0)
    assert final.finish_reason == "length"
    assert untimed == 0 and len(clock.times) == 3
    step = clock.times[1] - clock.times[0]
    assert gaps == pytest.approx([step / 2, step / 2])
    assert to_text == step  # the first token's text came with the second output


def test_outputs_put_before_the_clock_are_counted_untimed():
    request = GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=3))
    handle = RequestHandle(request, abort_fn=lambda _: None)
    handle.put(RequestOutput(request.request_id, [7], ""))
    clock = OutputClock(handle)
    handle.put(RequestOutput(request.request_id, [8], ""))
    handle.put(RequestOutput(request.request_id, [9], "", finish_reason="length"))
    _, gaps, untimed, to_text = clock.finish(timeout_s=1.0)
    assert untimed == 1 and to_text is None  # no output had text
    assert gaps == pytest.approx([clock.times[1] - clock.times[0]])


def test_burst_capacity_counts_the_first_three_quarters_of_a_burst():
    records = [{"e2e_s": t} for t in (4.0, 1.0, 3.0, 2.0, 9.0, 5.0, 6.0, 7.0)]
    assert burst_capacity(records) == pytest.approx(6 / 6.0)  # 6 done by 6 s; the tail ignored
    assert burst_capacity([{"e2e_s": 2.0}]) == pytest.approx(0.5)


def test_the_ttft_floor_bounds_each_request_by_the_longest_measured_length_below_it():
    alone = {64: 10.0, 2000: 1000.0, 3000: 2000.0}
    lens = [20] * 90 + [2500] * 9 + [3100]  # a P99 among 100 between the 99th and 100th
    assert ttft_floor(alone, lens) == pytest.approx(1000.0 + 0.01 * 1000.0)
    assert ttft_floor(alone, [10] * 5) == 0.0  # below every measured length: no bound
