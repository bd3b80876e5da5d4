"""The pool keeps its promises while adapters are on their way to the device.

An admitted request is promised its whole reservation of blocks. Adapter loads that nobody
promised anything to (a prefetch for a queued request) may take only blocks not promised, and
an adapter whose load is still running cannot be evicted to give blocks back, so admission
counts it. Before this, a Chameleon engine in the pool layout under overload failed a step with
"KV cache full" (bench_queueing --memory-layout pool, 2026-11-26): a prefetch had taken blocks
an admitted request was promised.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.server.engine.test_exactness import make_adapters
from toppings.gpu_lora.peft.adapter import load_peft_adapter
from toppings.server.config import EngineConfig, LoraConfig, MemoryConfig
from toppings.server.memory.build import build_memory
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.adapter_ref import AdapterRef

SPARE_BLOCKS = 10  # the pool: the adapter's blocks and these


@pytest.fixture
def pool(tiny_model_dir, tmp_path):
    """(memory manager, adapter, the adapter's blocks) of a pool whose adapter loads take ~60 s."""
    config = load_checkpoint(str(tiny_model_dir), "dummy").config
    paths = make_adapters(tmp_path, tiny_model_dir)
    adapter = load_peft_adapter(paths[max(paths)], config)
    probe = build(config, EngineConfig(memory_bytes=1 << 30, link_gbps=0.0))
    need = probe.blocks_for_bytes(probe.adapter_cache.charge(adapter))
    nbytes = (need + SPARE_BLOCKS) * probe.kv.block_bytes
    probe.adapter_cache.loader.close()
    engine = EngineConfig(memory_bytes=nbytes, link_gbps=adapter.num_bytes * 8 / 60 / 1e9,
                          prefix_cache=False, lora_mode="on-demand")  # fmt: skip
    memory = build(config, engine)
    yield memory, adapter, need
    memory.adapter_cache.loader.close()


def build(config, engine: EngineConfig):
    return build_memory(engine.part(MemoryConfig), engine.part(LoraConfig), "cpu", 4, config,
                        torch.float32, 4096, lambda: 0)  # fmt: skip


def request(tokens: int) -> SimpleNamespace:
    params = SimpleNamespace(prompt_logprobs=None)
    req = SimpleNamespace(prompt_ids=[1] * 8, adapter=None, params=params)
    return SimpleNamespace(
        request=req, prompt_len=8, prefill_ids=req.prompt_ids, prefill_len=8, kv_need=tokens,
        output_ids=[], lora_start=0, is_activated=False, scores_prompt=False,
    )  # fmt: skip


def test_a_prefetch_never_takes_blocks_promised_to_an_admitted_request(pool):
    memory, adapter, need = pool
    bt = memory.kv.block_tokens
    promised = memory.kv.num_blocks - need + 2  # leaves need - 2 blocks unpromised
    seq = request(promised * bt)
    assert memory.fits(memory.kv_need(seq, []))
    seq.kv_hold = memory.admit(seq, [], 0.0)
    assert memory.make_adapter_room(adapter, frozenset(), prefetch=True)  # reclaims nothing
    assert not memory.adapter_cache.prefetch(adapter)
    assert memory.allocate([seq], [promised * bt]) == [0]  # every promised block is there


def test_an_adapter_still_loading_counts_as_committed(pool):
    memory, adapter, need = pool
    assert memory.make_adapter_room(adapter, frozenset(), prefetch=True)
    assert memory.adapter_cache.prefetch(adapter)  # in flight for ~60 s
    ref = AdapterRef(adapter.id, adapter.name, adapter.rank, adapter.num_bytes)  # its id
    assert memory.adapter_need(ref, adapter.num_bytes) == 0  # counted once
    bt = memory.kv.block_tokens
    too_many = request((memory.kv.num_blocks - need + 1) * bt)
    assert not memory.fits(memory.kv_need(too_many, []))
    just = request((memory.kv.num_blocks - need) * bt)
    assert memory.fits(memory.kv_need(just, []))
    just.kv_hold = memory.admit(just, [], 0.0)
    assert memory.allocate([just], [just.kv_need]) == [0]
