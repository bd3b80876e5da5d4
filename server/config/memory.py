"""Device memory for KV blocks and adapters, the host tier behind it, and the prefix cache's
events (`MemoryConfig`, one part of server.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from toppings.gpu_lora.eviction import EVICTION_POLICIES
from toppings.server.settings import (
    ON_OFF,
    Bound,
    Flag,
    Settings,
    on_off,
    positive,
    setting,
)

MEMORY_LAYOUTS = ("pool", "static")  # the layouts: server.memory.layout
AUTO_EVICTION = "auto"  # the memory layout's own policy (server.memory.layout)
EVICTIONS = (AUTO_EVICTION, *EVICTION_POLICIES)  # the classes: gpu_lora.eviction
KV_EVENT_ENCODINGS = ("array", "map")  # server.kv_events.schema.EventEncoding


@dataclass(frozen=True)
class MemoryConfig(Settings):
    """Device memory for KV blocks and adapters, and the host tier behind it.

    With memory_layout "pool" (memory/manager.py), one budget of memory_bytes holds KV blocks
    and adapter weights. memory_bytes 0: on CUDA a share of the free device memory; on a CPU
    max_total_tokens of KV plus adapter_cache_bytes, and when that is 0 too, adapters are not
    charged (no limit). "static" splits memory in two: max_total_tokens of KV and
    adapter_cache_bytes of adapters. A request is admitted only when its prompt plus
    max_new_tokens fit in what is not yet promised.
    """

    title = "memory"

    max_total_tokens: int = setting(
        32768,
        bound=Bound.POSITIVE,
        flag=Flag(
            "KV cache size in tokens over all requests (the pool's default budget: see "
            "--memory-bytes)",
            type=int,
        ),
    )
    memory_layout: str = setting(
        "pool",
        choices=MEMORY_LAYOUTS,
        flag=Flag(
            "pool: one memory budget for KV blocks and adapters, which live in what KV does "
            "not use (ELORA/FastLibra); static: a fixed split, --max-total-tokens of KV and "
            "--adapter-cache-bytes of adapters"
        ),
    )
    # The pool's budget; 0: see the class docstring.
    memory_bytes: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "the pool's budget (0: 40%% of the free device memory on cuda; on a cpu "
            "--max-total-tokens of KV plus --adapter-cache-bytes, adapters unlimited when that "
            "is 0)",
            type=int,
            metavar="N",
        ),
    )
    # Reuse cached KV prefixes under the same adapter.
    prefix_cache: bool = setting(
        True,
        flag=Flag(
            "reuse cached KV of a prompt's prefix, under the request's own adapter only (an "
            "activated LoRA's blocks before its activation: under the base model)",
            choices=ON_OFF,
            default="on",
            parse=on_off,
        ),
    )
    # Host tier for KV blocks swapped out; 0: dropped instead.
    host_memory_bytes: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "host tier for KV blocks leaving the device (swapped back in on a hit when that "
            "beats recomputing them; --link-gbps throttles it on a cpu); 0: they are dropped",
            type=int,
            metavar="N",
        ),
    )
    # What leaves the device first, adapters and KV alike, in either layout (gpu_lora.eviction).
    eviction: str = setting(
        AUTO_EVICTION,
        choices=EVICTIONS,
        flag=Flag(
            "which cached item leaves the device first when room is needed, idle adapters and "
            "cached KV blocks alike, in either --memory-layout: lru, chameleon (frequency, "
            "recency and size), or fastlibra's cost model; auto: fastlibra with the pool "
            "layout, lru with the static one. --memory-policy is the same flag",
            aliases=("--memory-policy",),
        ),
    )
    block_tokens: int = setting(
        16,
        bound=Bound.POSITIVE,
        flag=Flag("tokens per KV block", type=positive, metavar="N"),
    )
    # Where the prefix cache's KV events go, in vLLM's schema (server/kv_events); None: off.
    kv_events_endpoint: str | None = setting(
        None,
        flag=Flag(
            "publish the prefix cache's KV cache events (vLLM's BlockStored / BlockRemoved / "
            "AllBlocksCleared, each block hashed with its adapter's name) on a ZMQ PUB socket "
            "bound here, e.g. tcp://*:5557, for KV-aware routers (llm-d, Dynamo); off by default",
            metavar="ENDPOINT",
        ),
    )
    kv_events_replay_endpoint: str | None = setting(
        None,
        flag=Flag(
            "a ZMQ ROUTER socket bound here, e.g. tcp://*:5558, answers a consumer that missed "
            "batches with those kept since the sequence number it sends (vLLM's replay)",
            metavar="ENDPOINT",
        ),
    )
    kv_events_topic: str = setting(
        "kv-events", flag=Flag("the topic frame of each published KV events batch")
    )
    kv_events_encoding: str = setting(
        "array",
        choices=KV_EVENT_ENCODINGS,
        flag=Flag(
            "array: every event positional, the layout all vLLM consumers decode; map: each "
            "event a map tagged under 'type', as vLLM sends since its PR #42892"
        ),
    )

    def check(self) -> None:
        if self.kv_events_endpoint and not self.prefix_cache:
            raise ValueError("kv_events_endpoint needs prefix_cache on: the events are its own")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
