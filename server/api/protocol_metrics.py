"""The model-server protocol of the Gateway API Inference Extension, on `/metrics`.

The extension's endpoint picker (the InferencePool's scheduler, also in llm-d and several
cloud gateways) routes by each model server's queue, KV cache use and LoRA state, read from
Prometheus series under the names it knows for vLLM. This collector publishes them beside our
own `toppings:` series, read at scrape time from one `engine.stats()` (the `/stats` body), so
that a scrape and the `/stats` of the same instant agree:

    vllm:num_requests_waiting{model_name}     gauge    requests queued, not admitted
    vllm:num_requests_running{model_name}     gauge    requests in the running batch
    vllm:kv_cache_usage_perc{model_name}      gauge    1 - free_kv_tokens / max_total_tokens
                                                       (a fraction in [0, 1], despite the name)
    vllm:gpu_cache_usage_perc{model_name}     gauge    the same, under the name the protocol
                                                       document's table and older pickers use
    vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
                                              gauge    value: the sample's Unix time
    vllm:prefix_cache_queries{model_name}     counter  prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits{model_name}        counter  of those, tokens whose KV was cached
    vllm:cache_config_info{block_size, num_gpu_blocks}
                                              gauge    1; the KV block size in tokens (the
                                                       size KV events hash blocks of) and the
                                                       pool's blocks, read by the prefix-cache
                                                       scorers (the protocol's optional
                                                       BlockSize and NumGPUBlocks)

Adapter residency, under the names of vLLM's residency metrics (vllm-project/vllm pull
requests #45411 and #54830, as read by llm-d-router's lora-load-state scorer, llm-d/llm-d-router
#2792):

    vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}
                                              gauge    1 per registered adapter: level "gpu"
                                                       when every layer is on the device, "cpu"
                                                       when only host memory holds it (a load
                                                       still running included)
    vllm:num_gpu_loaded_lora_adapters{model_name}   gauge   adapters at level "gpu"
    vllm:num_cpu_loaded_lora_adapters{model_name}   gauge   adapters at level "cpu"
    vllm:max_gpu_lora_adapters{model_name}          gauge   the device's adapter capacity
                                                            (`/stats` max_device_adapters)
    vllm:lora_adapter_load_seconds{model_name}      histogram  adapter loads, from the request
                                                            that asked for it to its last layer
                                                            on the device

and our three states, which vLLM's two levels fold: `toppings:lora_adapter_state{adapter_name,
state="device"|"loading"|"host", pinned, rank}` (1 per registered adapter). `pinned` is "true"
while the adapter cannot leave the device (a request holds it, its load runs, or the LoRA mode
keeps every adapter there). Every series comes from the `/stats` of the same scrape (its
`adapters`, `num_*_adapters`, `max_device_adapters` and `adapter_load_seconds`).

`running_lora_adapters` are the adapters "loaded in GPU memory and ready to serve" (the
document's words): the resident ones, with those of the running requests;
`waiting_lora_adapters` those of the queued requests; each sorted, comma-separated, "" for
none. `max_lora` is how many distinct adapters one batch may hold: any request of a batch may
use its own adapter here (the LoRA kernels gather per request), so it is the batch size limit
(`--max-batch-size`). vLLM sets the info
gauge to the time of its sample so that the picker keeps the newest label set; one set is
published per scrape here, with the same value.

Checked against the protocol document's text (gateway-api-inference-extension,
docs/proposals/003-model-server-protocol/README.md: TotalQueuedRequests, KVCacheUtilization,
the LoRA info gauge and its three labels), see README "Running on Kubernetes".
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from toppings.server.requests.engine_counters import MemoryView
from toppings.server.requests.stats_schema import RequestView, Residency, ServerStats

PREFIX = "vllm:"
OWN_PREFIX = "toppings:"
LOADED_LABELS = ["adapter_name", "level", "pinned", "rank"]
STATE_LABELS = ["adapter_name", "state", "pinned", "rank"]
LEVELS = {Residency.DEVICE: "gpu", Residency.LOADING: "cpu", Residency.HOST: "cpu"}
MODEL_LABEL = "model_name"
LORA_INFO_LABELS = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]


class StatsEngine(Protocol):
    """What the protocol series read of the engine."""

    def stats(self) -> ServerStats: ...


def adapter_names(requests: tuple[RequestView, ...]) -> set[str]:
    """The distinct adapter names of `requests`."""
    return {r.adapter for r in requests if r.adapter is not None}


def adapter_list(requests: tuple[RequestView, ...]) -> str:
    """The distinct adapter names of `requests`, sorted and comma-separated ("" for none)."""
    return ",".join(sorted(adapter_names(requests)))


def memory_series(view: dict, model: list[str]) -> Iterator[Metric]:
    """The prefix cache's counters and the KV block configuration, from /stats' MEMORY (none
    when a server reports no memory view)."""
    if not view:
        return
    memory = MemoryView.from_view(view)
    counters = (
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
         memory.prompt_tokens),
        ("prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache",
         memory.prefix_hit_tokens),
    )  # fmt: skip
    for name, doc, value in counters:
        family = CounterMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
        family.add_metric(model, value)
        yield family
    if memory.block_tokens is not None:
        config = GaugeMetricFamily(PREFIX + "cache_config_info",
                                   "KV cache configuration: block size in tokens, blocks",
                                   labels=["block_size", "num_gpu_blocks"])  # fmt: skip
        config.add_metric([str(memory.block_tokens), str(memory.blocks.total)], 1)
        yield config


def kv_cache_usage(stats: ServerStats) -> float:
    """The fraction of KV token slots promised to admitted requests (and, in the pool layout,
    taken by adapters): what a new request cannot have."""
    if stats.max_total_tokens <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - stats.free_kv_tokens / stats.max_total_tokens))


class ProtocolCollector:
    """The protocol's series of one server, from one `engine.stats()` per scrape."""

    def __init__(
        self, engine: StatsEngine, max_lora: int, read=lambda fn: fn(), adapter_series: str = "all"
    ):
        """max_lora: distinct adapters one batch may hold; read: calls the stats reader (the
        metrics module retries the rare race of a reader walking live lists); adapter_series:
        which adapters get series of their own (`--adapter-series`: all, device, off)."""
        self.engine = engine
        self.max_lora = max_lora
        self.read = read
        self.adapter_series = adapter_series

    def collect(self) -> Iterator[Metric]:
        stats = self.read(self.engine.stats)
        model = [stats.model]
        gauges = (
            ("num_requests_waiting", "Requests queued, not admitted", len(stats.queue)),
            ("num_requests_running", "Requests in the running batch", len(stats.running)),
            ("kv_cache_usage_perc", "KV cache usage as a fraction (1 = full)",
             kv_cache_usage(stats)),
            ("gpu_cache_usage_perc", "KV cache usage as a fraction (1 = full)",
             kv_cache_usage(stats)),
        )  # fmt: skip
        for name, doc, value in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
            family.add_metric(model, value)
            yield family
        yield from memory_series(stats.memory, model)
        lora = GaugeMetricFamily(PREFIX + "lora_requests_info",
                                 "Adapters resident or running, and of the waiting requests; "
                                 "value: the sample's time", labels=LORA_INFO_LABELS)  # fmt: skip
        ready = set(stats.resident_adapters) | adapter_names(stats.running)
        running = ",".join(sorted(ready))
        waiting = adapter_list(stats.queue)
        lora.add_metric([running, waiting, str(self.max_lora)], time.time())
        yield lora
        yield from residency_series(stats, self.adapter_series)


def residency_series(stats: ServerStats, which: str = "all") -> Iterator[Metric]:
    """The adapter residency series of the module docstring, from one `/stats`; `which`
    adapters get series of their own: all, those on the device or loading there ("device"),
    or none ("off")."""
    loaded = GaugeMetricFamily(PREFIX + "lora_adapter_loaded",
                               "Registered adapters by level: gpu (on the device) or cpu (host "
                               "memory only)", labels=LOADED_LABELS)  # fmt: skip
    state = GaugeMetricFamily(OWN_PREFIX + "lora_adapter_state",
                              "Registered adapters by state: device, loading or host",
                              labels=STATE_LABELS)  # fmt: skip
    shown = {"all": stats.adapters, "off": ()}.get(which)
    if shown is None:
        shown = [a for a in stats.adapters if a.state is not Residency.HOST]
    for a in shown:
        pinned, rank = str(a.pinned).lower(), str(a.rank)
        loaded.add_metric([a.name, LEVELS[a.state], pinned, rank], 1)
        state.add_metric([a.name, a.state.value, pinned, rank], 1)
    yield loaded
    yield state
    model = [stats.model]
    counts = (
        ("num_gpu_loaded_lora_adapters", "Adapters with every layer on the device",
         stats.num_device_adapters),
        ("num_cpu_loaded_lora_adapters", "Adapters in host memory only (loads running included)",
         stats.num_host_adapters + stats.num_loading_adapters),
        ("max_gpu_lora_adapters", "Adapters of the registered ones' mean size the device's "
         "adapter memory holds", stats.max_device_adapters),
    )  # fmt: skip
    for name, doc, value in counts:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
        family.add_metric(model, value)
        yield family
    times = stats.adapter_load_seconds
    if times:
        buckets = [(repr(float(b)), c) for b, c in zip(times["bounds"], times["cumulative"],
                                                        strict=True)]  # fmt: skip
        buckets.append(("+Inf", times["count"]))
        family = HistogramMetricFamily(PREFIX + "lora_adapter_load_seconds",
                                       "Adapter loads: request to last layer on the device",
                                       labels=[MODEL_LABEL])  # fmt: skip
        family.add_metric(model, buckets, times["sum_s"])
        yield family
