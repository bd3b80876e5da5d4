"""The per-layer trace of one cold request (gpu_lora/trace.py), in each LoRA mode.

The recorder must see every layer group's copy of the adapter and, in cpu-assisted mode, a host
LoRA call at each layer the prefill reached before that layer was resident. The link is slow
enough (the whole adapter in about two seconds, a group every half second) that the last groups
arrive after the tiny model's prefill; what is asserted follows from the order of events, never
from how long anything took.
"""

from __future__ import annotations

import time

import pytest

from toppings.gpu_lora.trace import StepEvent, TraceRecorder
from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

NUM_LAYERS = 4
LOAD_S = 2.0
ADAPTER_BYTES = 64 * (64 + 64) * 4 * 7 * NUM_LAYERS  # about: rank 64, 7 projections, float32
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny_trace"), num_layers=NUM_LAYERS)
    adapter = make_random_adapter(tmp_path_factory.mktemp("trace_r64"), model_dir, rank=64)
    return str(model_dir), str(adapter)


def trace_one_request(model_and_adapter, mode: str, stream_tokens: int = 0) -> TraceRecorder:
    """Run one request for the adapter on an engine that has served only the base model; return
    its events once the adapter's load has ended. `stream_tokens`: a base-model request of that
    many tokens is decoding when the adapter's request arrives."""
    model_dir, adapter = model_and_adapter
    config = EngineConfig(
        dtype="float32", lora_mode=mode, max_total_tokens=1024, max_batch_size=4,
        max_num_batched_tokens=256,  # the prompt in one step, whatever the start-up timing
        link_gbps=0.0 if mode == "cached" else ADAPTER_BYTES * 8 / LOAD_S / 1e9,
    )  # fmt: skip
    trace = TraceRecorder()
    engine = build_engine(model_dir, config, {"r64": adapter}, trace=trace)
    try:
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest(PROMPT, params, None)).result(timeout_s=60)  # warm-up
        trace.clear()
        stream = None
        if stream_tokens:
            long = SamplingParams(max_new_tokens=stream_tokens, temperature=0.0, ignore_eos=True)
            stream = engine.submit(GenerationRequest(PROMPT, long, None))
            deadline = time.monotonic() + 60
            while not any(not s.is_prefill for s in trace.steps):
                assert time.monotonic() < deadline, "the stream did not start decoding"
                time.sleep(0.01)
        engine.submit(GenerationRequest(PROMPT, params, engine.resolve_adapter("r64"))).result(
            timeout_s=60
        )
        if stream is not None:
            stream.result(timeout_s=120)
        deadline = time.monotonic() + 60
        while mode != "cached" and len(trace.copies) < NUM_LAYERS:
            assert time.monotonic() < deadline, "the load did not end"
            time.sleep(0.05)
    finally:
        engine.shutdown()
    return trace


def steps_within_the_load(trace: TraceRecorder) -> list[StepEvent]:
    """Steps that began after the adapter's first copy started and ended before its last copy
    was resident."""
    begin = min(c.start_s for c in trace.copies)
    end = max(c.ready_s for c in trace.copies)
    return [s for s in trace.steps if s.start_s >= begin and s.end_s <= end]


def prefill_of(trace: TraceRecorder):
    (prefill,) = [s for s in trace.steps if s.is_prefill]
    assert prefill.num_tokens == len(PROMPT)
    return prefill


def copy_of(trace: TraceRecorder, layer: int):
    (event,) = [c for c in trace.copies if c.first_layer <= layer < c.end_layer]
    return event


@pytest.mark.parametrize("mode", ["on-demand", "cpu-assisted"])
def test_every_layer_group_copy_is_recorded(model_and_adapter, mode):
    trace = trace_one_request(model_and_adapter, mode)
    covered = sorted(layer for c in trace.copies for layer in range(c.first_layer, c.end_layer))
    assert covered == list(range(NUM_LAYERS))
    assert len({c.adapter_id for c in trace.copies}) == 1  # one adapter: r64, by its id
    for c in trace.copies:
        assert c.num_bytes > 0
        assert c.start_s <= c.copied_s <= c.ready_s


def test_cpu_assisted_runs_the_layers_not_loaded_yet_on_the_host(model_and_adapter):
    trace = trace_one_request(model_and_adapter, "cpu-assisted")
    prefill = prefill_of(trace)
    in_prefill = [h for h in trace.host_calls if prefill.start_s <= h.start_s <= prefill.end_s]
    marks = [m for m in trace.marks if prefill.start_s <= m.at_s <= prefill.end_s]
    assert {m.layer for m in marks} == set(range(NUM_LAYERS))
    # A group resident only after the prefill ended was missing at each of its layers.
    late = [n for n in range(NUM_LAYERS) if copy_of(trace, n).ready_s > prefill.end_s]
    assert late, "the whole adapter arrived before the prefill ended: the link is not slow enough"
    host_layers = {h.layer for h in in_prefill}
    assert set(late) <= host_layers
    for h in in_prefill:
        assert h.adapter_ids == (copy_of(trace, h.layer).adapter_id,)  # r64's, by its id
        # The layer went to the host because, when the forward reached it, it was not resident.
        reached = max(m.at_s for m in marks if m.layer == h.layer and m.at_s <= h.start_s)
        assert copy_of(trace, h.layer).ready_s > reached


def test_on_demand_prefills_after_the_whole_load_and_calls_no_host(model_and_adapter):
    trace = trace_one_request(model_and_adapter, "on-demand")
    prefill = prefill_of(trace)
    assert trace.host_calls == []
    assert prefill.start_s >= max(c.copied_s for c in trace.copies)


def test_cached_request_copies_nothing(model_and_adapter):
    trace = trace_one_request(model_and_adapter, "cached")
    prefill = prefill_of(trace)
    assert trace.copies == [] and trace.host_calls == []
    assert {m.layer for m in trace.marks if m.at_s <= prefill.end_s} == set(range(NUM_LAYERS))


def test_on_demand_sync_stalls_every_request_for_the_load(model_and_adapter):
    """S-LoRA's way: the step that starts the cold request waits for its adapter, with the base
    model's stream in it (before its forward pass, which never waits on a load); on-demand lets
    the stream decode meanwhile."""
    trace = trace_one_request(model_and_adapter, "on-demand-sync", stream_tokens=400)
    assert steps_within_the_load(trace) == [] and trace.host_calls == []
    (cold,) = [s for s in trace.steps if s.is_prefill and s.end_s > trace.copies[0].start_s]
    assert max(c.ready_s for c in trace.copies) <= cold.start_s
    # the stream's last forward before it ended before the load began: it stalled throughout
    before = [s for s in trace.steps if s.end_s <= cold.start_s]
    assert before and max(s.end_s for s in before) <= trace.copies[0].start_s

    trace = trace_one_request(model_and_adapter, "on-demand", stream_tokens=400)
    assert [s for s in steps_within_the_load(trace) if not s.is_prefill]
