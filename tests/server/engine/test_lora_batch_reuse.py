"""A decode step runs the last step's LoraBatch again only when nothing it is made of moved: the
decode batch's rows (their generation), the adapter pool (its generation: an adapter placed,
moved, renamed or removed, tables grown) and the thread count; a prefill, a step without a
generation, other rows, a pool that moved or another thread count get a new one."""

from __future__ import annotations

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
        step, cache, pool = engine.runner.lora, engine.lora.cache, engine.runner.lora.pool
        x, z = (next(e for e in cache.entries.values() if e.resident.name == n) for n in "xz")
        seg = [0, 1, 2]
        first = step.step([x, z], seg, False, generation=1007)
        assert first.version is not None
        assert step.step([x, z], seg, False, generation=1007) is first
        assert step.step([x, z], seg, False) is not first  # no generation: this step alone
        assert step.step([x, z], seg, False, generation=1007) is not first  # the last was that
        second = step.step([x, z], seg, False, generation=1007)
        assert step.step([x, z], seg, True, generation=1007) is not second  # a prefill: anew
        third = step.step([x, z], seg, False, generation=1007)
        assert third is not second and third.version != second.version
        assert step.step([z, x], seg, False, generation=1008) is not third  # the rows changed
        fourth = step.step([x, z], seg, False, generation=1009)
        pool.rename(x.resident.id, "x2")  # the pool moved on: its generation with it
        fifth = step.step([x, z], seg, False, generation=1009)
        assert fifth is not fourth
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            assert step.step([x, z], seg, False, generation=1009) is not fifth
        finally:
            torch.set_num_threads(threads)
        sixth = step.step([x, z], seg, False, generation=1009)
        assert step.step([x, z], seg, False, generation=1009) is sixth
        assert step.step([None, None], seg, False, generation=1009) is None  # base rows only
    finally:
        engine.shutdown()
