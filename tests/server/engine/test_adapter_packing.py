"""Adapters whose rows move in the device pool to make room for a load (gpu_lora/cache.py's
packing) keep giving their running requests transformers + PEFT's greedy tokens."""

from __future__ import annotations

import time

import torch

from tests.server.engine.test_chunked_prefill import build_engine
from tests.server.engine.test_exactness import NEW_TOKENS, assert_same_greedy, reference_greedy
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

TARGETS = ("q_proj", "v_proj")
RANKS = {"x": 64, "y": 64, "z": 64, "big": 128}


def drive(engine, until, deadline_s: float = 120.0) -> None:
    """Run the engine's steps until `until()` (an adapter load may leave a step with nothing
    to run: on-demand waits for it)."""
    deadline = time.monotonic() + deadline_s
    while not until():
        assert time.monotonic() < deadline
        if engine.step() is None:
            time.sleep(0.002)


def test_rows_moved_under_running_requests_keep_their_tokens(tmp_path_factory, tiny_model_dir):
    # x, y, z (rank 64) take rows 0-191 of a 256-row budget. y's request ends; big's (rank 128)
    # fits the budget in bytes once y is evicted, but not in one row range until z moves to
    # rows 64-127 while x's and z's requests are decoding.
    root = tmp_path_factory.mktemp("packing_adapters")
    adapters = {
        name: str(make_random_adapter(root / name, tiny_model_dir, rank=rank,
                                      target_modules=TARGETS, seed=i))
        for i, (name, rank) in enumerate(RANKS.items())
    }  # fmt: skip
    shapes = load_checkpoint(str(tiny_model_dir), "dummy").config
    budget = AdapterPool(shapes, torch.float32, "cpu").bytes_for(256, TARGETS)
    config = EngineConfig(dtype="float32", lora_mode="on-demand", adapter_cache_bytes=budget,
                          max_total_tokens=4096, max_batch_size=8)  # fmt: skip
    engine = build_engine(tiny_model_dir, config, adapters)
    gen = torch.Generator().manual_seed(4)
    prompts = {n: torch.randint(3, 200, (5 + 2 * i,), generator=gen).tolist()
               for i, n in enumerate(RANKS)}  # fmt: skip

    def submit(name: str, new_tokens: int):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return engine.submit(GenerationRequest(prompts[name], params, engine.resolve_adapter(name)))

    def busy(name: str) -> bool:
        stats = engine.stats().to_json()
        return any(r["adapter"] == name for r in stats["running"] + stats["queue"])

    try:
        handles = {name: submit(name, 2 if name == "y" else NEW_TOKENS) for name in "xyz"}
        drive(engine, lambda: busy("y"))  # submitted requests reach the queue at a step
        drive(engine, lambda: not busy("y"))
        assert busy("x") and busy("z"), "x and z must still be decoding when big arrives"
        offsets = {e.resident.name: e.resident.offset for e in engine.lora.cache.entries.values()}
        assert offsets == {"x": 0, "y": 64, "z": 128}, offsets
        handles["big"] = submit("big", NEW_TOKENS)
        drive(engine, lambda: not engine.scheduler.has_work())
        outputs = {n: h.result(timeout_s=5).new_token_ids for n, h in handles.items()}
        compactions = engine.lora.cache.counters.compactions
        offsets = {e.resident.name: e.resident.offset for e in engine.lora.cache.entries.values()}
    finally:
        engine.shutdown()
    assert compactions == 1 and offsets == {"x": 0, "z": 64, "big": 128}, (compactions, offsets)
    for name in ("x", "z", "big"):
        ref, margins = reference_greedy(tiny_model_dir, adapters, prompts[name], name)
        assert_same_greedy(outputs[name], ref, margins, f"adapter {name}")
