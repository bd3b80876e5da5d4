"""Builds the node's memory side in one place: the KV pool, the prefix tree, the host tier,
the adapter cache and the managers that share them.

Calls point one way: the reclaimer (the node's one owner of eviction, holding the `Eviction`
table) evicts from the adapter cache and the prefix tree; the adapter cache charges the adapter
blocks, which take only free blocks and call nothing back. The blocks ask the manager, built
after them, what is not promised, through a forward reference. The KV pool calls nothing: the
manager makes room before it reserves a step's slots, and before an adapter's load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.eviction import Eviction
from toppings.gpu_lora.loader import PipelinedLoader
from toppings.gpu_lora.targets import ModelShapes
from toppings.gpu_lora.trace import TraceRecorder
from toppings.server.config import LoraConfig, MemoryConfig
from toppings.server.kv_events.build import start_kv_events
from toppings.server.kv_events.publisher import Sink
from toppings.server.memory.adapter_blocks import AdapterBlocks
from toppings.server.memory.counters import MemoryCounters
from toppings.server.memory.host_swap import HostSwap
from toppings.server.memory.host_tier import HostKV
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.layout import KVShape, make_layout
from toppings.server.memory.manager import MemoryManager
from toppings.server.memory.prefix_tree import PrefixTree
from toppings.server.memory.reclaim import Reclaimer


class MemoryShapes(KVShape, ModelShapes, Protocol):
    """What the memory side reads of the base model: its KV shape and, for the adapter pool,
    its projections (the server's ModelConfig fits)."""


def build_memory(
    memory: MemoryConfig,
    lora: LoraConfig,
    device: str,
    max_batch_size: int,
    model_config: MemoryShapes,
    dtype: torch.dtype,
    max_model_len: int,
    free_device_bytes: Callable[[], int],
    trace: TraceRecorder | None = None,
    kv_sink: Sink | None = None,
) -> MemoryManager:
    """The engine's memory (its KV pool is `.kv`, its adapter cache `.adapter_cache`).

    memory: the memory part of the engine's configuration (with the eviction policy); lora:
    its LoRA part (the adapter cache's budget, the loader's layer groups, the emulated link);
    max_batch_size: the KV pool's rows; free_device_bytes: () -> free bytes of the device
    (asked only on CUDA without a budget); trace: the adapter loader's copies go to it (None:
    no tracing); kv_sink: where the prefix cache's KV events go instead of
    `memory.kv_events_endpoint` (tests capture them in-process).
    """
    cfg, mc = memory, model_config
    layout = make_layout(
        cfg.memory_layout, cfg, device=device, adapter_cache_bytes=lora.adapter_cache_bytes
    )
    manager: MemoryManager | None = None

    def unpromised() -> int:
        return manager.kv.num_blocks - manager.committed()

    kv = KVPool(
        mc.num_layers,
        layout.kv_slots(mc, dtype.itemsize, free_device_bytes),
        mc.num_kv_heads,
        mc.head_dim,
        max_batch_size,
        max_model_len,
        dtype,
        device,
        cfg.block_tokens,
    )
    counters = MemoryCounters()
    tree: PrefixTree | None = None
    events = start_kv_events(cfg, kv.block_tokens, lambda: tree.nodes(), kv_sink)
    if cfg.prefix_cache:
        tree = PrefixTree(kv.block_tokens, events.recorder if events is not None else None)
    host_blocks = cfg.host_memory_bytes // kv.block_bytes
    swap = None
    if host_blocks and tree is not None:
        swap = HostSwap(kv, tree, HostKV(kv, host_blocks, lora.link_gbps), counters)
    blocks = AdapterBlocks(kv, unpromised) if layout.charges_adapters() else None
    pool = AdapterPool(mc, dtype, device)
    loader = PipelinedLoader(
        pool, lora.layers_per_group, lora.link_gbps, lora.link_latency_us, lora.host_cores, trace
    )
    cache = AdapterCache(
        pool, loader, lora.adapter_cache_bytes or None, memory=blocks, keep_idle=lora.adapter_cache
    )
    # The one owner of eviction, with the one table both layouts ask.
    eviction = Eviction.named(layout.eviction())
    reclaimer = Reclaimer(kv, tree, swap, cache, blocks, counters, eviction)
    manager = MemoryManager(kv, layout, tree, swap, blocks, cache, reclaimer, counters, events)
    return manager
