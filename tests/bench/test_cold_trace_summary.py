"""bench/cold_trace.py's summary of one request's events, on hand-made events (no model)."""

from __future__ import annotations

import pytest

from bench.cold_trace import summarise
from toppings.gpu_lora.trace import (
    CopyEvent,
    HostLoraEvent,
    LayerMark,
    StepEvent,
    TraceRecorder,
)


def two_layer_trace() -> TraceRecorder:
    """Submitted at 0: layer 0 resident at 0.03 s, layer 1 at 0.25 s; the prefill runs
    0.01-0.20 s, layer 0 on the device, layer 1 on the host (0.12-0.15 s); one decode step."""
    trace = TraceRecorder()
    trace.copy_group(CopyEvent(7, 0, 1, 100, 0.002, 0.004, 0.03))
    trace.copy_group(CopyEvent(7, 1, 2, 100, 0.03, 0.032, 0.25))
    trace.step(StepEvent(True, 16, 0.01, 0.20))
    for layer, at in ((0, 0.02), (0, 0.09), (1, 0.11), (1, 0.18)):
        trace.marks.append(LayerMark(layer, at))
    trace.host_lora(HostLoraEvent(1, ("q_proj", "v_proj"), (7,), 0.12, 0.15))
    trace.step(StepEvent(False, 1, 0.21, 0.26))
    trace.host_lora(HostLoraEvent(1, ("q_proj",), (7,), 0.22, 0.23))
    return trace


def test_layers_totals_and_overlap():
    got = summarise(two_layer_trace(), submitted=0.0, ttft_s=0.205, num_layers=2)
    assert [r["forward_ms"] for r in got["layers"]] == pytest.approx([80.0, 90.0])
    assert [r["host_lora_calls"] for r in got["layers"]] == [0, 1]
    assert got["layers"][1]["host_lora_ms"] == pytest.approx(30.0)
    assert got["layers"][1]["resident_ms"] == pytest.approx(250.0)
    assert got["prefill_ms"] == pytest.approx(190.0)
    assert got["host_lora_ms"] == pytest.approx(30.0)
    assert got["forward_less_host_ms"] == pytest.approx(160.0)
    assert got["head_ms"] == pytest.approx(20.0)
    assert got["load_ms"] == pytest.approx(248.0)
    assert got["load_prefill_overlap_ms"] == pytest.approx(190.0)  # the load spans the prefill
    assert got["copy_busy_ms"] == pytest.approx(4.0)
    assert (got["decode_steps"], got["decode_host_lora_calls"]) == (1, 1)
    assert got["ttft_ms"] == pytest.approx(205.0)


def test_a_cached_request_has_no_load():
    trace = TraceRecorder()
    trace.step(StepEvent(True, 16, 0.01, 0.05))
    trace.marks.append(LayerMark(0, 0.04))
    got = summarise(trace, submitted=0.0, ttft_s=0.05, num_layers=1)
    assert got["load_ms"] is None and got["load_prefill_overlap_ms"] == 0.0
    assert got["layers"][0]["copy_start_ms"] is None
    assert got["layers"][0]["forward_ms"] == pytest.approx(30.0)
