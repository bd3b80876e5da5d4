"""Where the time of one cold request goes, layer by layer (`bench_cpu_assisted --trace`).

One request for an adapter that is not on the device (in `cached` mode: preloaded) runs alone
on an engine that has served only the base model, with a `gpu_lora.trace.TraceRecorder`. The
summary gives, in milliseconds from the request's submission: each layer group's copy (the
loader began it, the copies returned, the emulated link delivered it), each layer's time on
the engine thread in the prefill (from the previous layer's last LoRA point to its own: base
matmuls, attention and LoRA, host calls included) and the part of it spent in host LoRA calls
(submit to the CPU workers and wait), and the totals: copy, host LoRA, forward, the overlap of
the load with the prefill, TTFT.
"""

from __future__ import annotations

import time

from toppings.gpu_lora.trace import TraceRecorder
from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine


def trace_cold_request(
    model_dir: str,
    config: EngineConfig,
    adapters: dict[str, str],
    adapter: str,
    prompt: list[int],
    new_tokens: int,
    timeout_s: float = 1800,
) -> dict:
    """Run one request for `adapter` on a fresh engine of `config` and summarise its trace."""
    trace = TraceRecorder()
    engine = build_engine(model_dir, config, adapters, trace=trace)
    try:
        warm = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        for _ in range(2):  # the base model only: no adapter is loaded by the warm-up
            engine.submit(GenerationRequest(prompt, warm, None)).result(timeout_s=timeout_s)
        trace.clear()
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        submitted = time.perf_counter()
        out = engine.submit(
            GenerationRequest(prompt, params, engine.resolve_adapter(adapter))
        ).result(timeout_s=timeout_s)
        num_layers = engine.model_config.num_layers
        deadline = time.monotonic() + timeout_s
        # The load may outlive the request (decode steps ran on the host); its last group's
        # event is written just after the group is marked resident.
        while adapter in engine.lora.residency()[1] or (
            trace.copies and sum(c.end_layer - c.first_layer for c in trace.copies) < num_layers
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the load of {adapter} did not end")
            time.sleep(0.01)
    finally:
        engine.shutdown()
    return {"adapter": adapter, **summarise(trace, submitted, out.ttft_s, num_layers)}


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def summarise(trace: TraceRecorder, submitted: float, ttft_s: float, num_layers: int) -> dict:
    """The trace of one request submitted at `submitted` (perf_counter seconds), in ms from
    then; see the module docstring."""

    def ms(t: float) -> float:
        return round(1000 * (t - submitted), 3)

    prefill = next(s for s in trace.steps if s.is_prefill)
    span = (prefill.start_s, prefill.end_s)
    host = [h for h in trace.host_calls if span[0] <= h.start_s <= span[1]]
    marks = [m for m in trace.marks if span[0] <= m.at_s <= span[1]]
    layer_end = {m.layer: m.at_s for m in marks}  # the last LoRA point of each layer
    layers, previous = [], prefill.start_s
    for layer in range(num_layers):
        copy = next((c for c in trace.copies if c.first_layer <= layer < c.end_layer), None)
        end = layer_end.get(layer, previous)
        calls = [h for h in host if h.layer == layer]
        layers.append({
            "layer": layer,
            "copy_start_ms": None if copy is None else ms(copy.start_s),
            "copy_done_ms": None if copy is None else ms(copy.copied_s),
            "resident_ms": None if copy is None else ms(copy.ready_s),
            "forward_start_ms": ms(previous),
            "forward_ms": round(1000 * (end - previous), 3),
            "host_lora_calls": len(calls),
            "host_lora_ms": round(1000 * sum(h.end_s - h.start_s for h in calls), 3),
        })  # fmt: skip
        previous = end
    decode = [s for s in trace.steps if not s.is_prefill]
    later_host = [h for h in trace.host_calls if h.start_s > span[1]]
    load = None
    if trace.copies:
        load = (min(c.start_s for c in trace.copies), max(c.ready_s for c in trace.copies))
    prefill_ms = 1000 * (prefill.end_s - prefill.start_s)
    host_ms = sum(r["host_lora_ms"] for r in layers)
    return {
        "ttft_ms": round(1000 * ttft_s, 3),
        "prefill_start_ms": ms(prefill.start_s),
        "prefill_ms": round(prefill_ms, 3),
        "prefill_tokens": prefill.num_tokens,
        "load_ms": None if load is None else round(1000 * (load[1] - load[0]), 3),
        "load_resident_ms": None if load is None else ms(load[1]),
        "copy_busy_ms": round(1000 * sum(c.copied_s - c.start_s for c in trace.copies), 3),
        "host_lora_ms": round(host_ms, 3),
        "host_lora_calls": len(host),
        "forward_less_host_ms": round(prefill_ms - host_ms, 3),
        "head_ms": round(1000 * (prefill.end_s - previous), 3),
        "load_prefill_overlap_ms": 0.0 if load is None else round(1000 * _overlap(load, span), 3),
        "decode_steps": len(decode),
        "decode_ms": round(1000 * sum(s.end_s - s.start_s for s in decode), 3),
        "decode_host_lora_calls": len(later_host),
        "decode_host_lora_ms": round(1000 * sum(h.end_s - h.start_s for h in later_host), 3),
        "layers": layers,
    }
