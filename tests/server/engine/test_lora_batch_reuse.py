"""A decode step runs the last step's LoraBatch again only when it would be built the same:
the same adapters at the same pool rows, the same runs, the same pool tables and thread count;
a prefill, a step of other adapters or rows, moved rows or grown tables get a new one."""

from __future__ import annotations

from dataclasses import replace

import torch

from tests.server.engine.test_adapter_packing import drive
from tests.server.engine.test_chunked_prefill import build_engine
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, SamplingParams


def test_decode_steps_reuse_the_lora_batch_only_while_nothing_changed(
    tmp_path_factory, tiny_model_dir
):
    root = tmp_path_factory.mktemp("reuse_adapters")
    adapters = {
        name: str(make_random_adapter(root / name, tiny_model_dir, rank=rank,
                                      target_modules=("q_proj", "v_proj"), seed=i))
        for i, (name, rank) in enumerate((("x", 8), ("z", 8)))
    }  # fmt: skip
    engine = build_engine(
        tiny_model_dir, EngineConfig(dtype="float32", lora_mode="cached"), adapters
    )

    def load(name: str) -> None:  # a request of the adapter, run to its end
        params = SamplingParams(max_new_tokens=2, temperature=0.0)
        engine.submit(GenerationRequest([5, 6, 7], params, engine.resolve_adapter(name)))
        drive(engine, lambda: not engine.scheduler.has_work())

    try:
        load("x")
        load("z")
        step, cache = engine.runner.lora, engine.lora.cache
        x, z = (next(e for e in cache.entries.values() if e.resident.name == n) for n in "xz")
        first = step.step([x, z], [0, 1, 2], False)
        assert step.step([x, z], [0, 1, 2], False) is first
        x.resident = replace(x.resident)  # equal: still the same rows
        assert step.step([x, z], [0, 1, 2], False) is first
        assert step.step([x, z], [0, 1, 2], True) is not first  # a prefill: built anew
        second = step.step([x, z], [0, 1, 2], False)
        assert second is not first  # the last one was the prefill's
        assert step.step([z, x], [0, 1, 2], False) is not second
        third = step.step([x, None], [0, 1, 2], False)
        assert step.step([x, None], [0, 1, 3], False) is not third  # other runs
        fourth = step.step([x, z], [0, 1, 2], False)
        x.resident = replace(x.resident, offset=x.resident.offset + 1)  # rows moved
        fifth = step.step([x, z], [0, 1, 2], False)
        assert fifth is not fourth
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            assert step.step([x, z], [0, 1, 2], False) is not fifth
        finally:
            torch.set_num_threads(threads)
        sixth = step.step([x, z], [0, 1, 2], False)
        tables = step.pool.lora_a
        tables["q_proj"] = tables["q_proj"].clone()  # as the pool's `_resize` replaces them
        assert step.step([x, z], [0, 1, 2], False) is not sixth
    finally:
        engine.shutdown()
