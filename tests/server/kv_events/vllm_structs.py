"""vLLM's KV event structs (vllm/distributed/kv_events.py), field for field, to decode what we
send as a vLLM consumer would.

No `from __future__ import annotations` here, unlike the house rule: msgspec resolves the
annotations of these function-local classes, which only works when they are real objects."""

from typing import Any

import msgspec


def vllm_structs(array_like: bool):
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
