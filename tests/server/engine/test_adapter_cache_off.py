"""`--adapter-cache off` on a running engine: each request that finds its adapter gone loads it
again, nothing stays on the device once the requests end, and the tokens are those of the
cached engine."""

from __future__ import annotations

import pytest

from tests.server.engine.test_exactness import make_adapters
from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine


@pytest.mark.parametrize("mode", ["on-demand", "on-demand-sync"])
def test_requests_one_after_another_load_their_adapter_each_time(tiny_model_dir, tmp_path, mode):
    adapters = make_adapters(tmp_path, tiny_model_dir)
    name = sorted(adapters)[0]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 9, 17, 3 + i] for i in range(3)]
    got, loads, resident = {}, {}, {}
    for keep in (True, False):
        config = EngineConfig(dtype="float32", lora_mode=mode, adapter_cache=keep,
                              max_total_tokens=1024, max_batch_size=4)  # fmt: skip
        engine = build_engine(str(tiny_model_dir), config, adapters)
        try:
            ref = engine.resolve_adapter(name)
            got[keep] = [engine.submit(GenerationRequest(p, params, ref)).result(timeout_s=120)
                         .new_token_ids for p in prompts]  # fmt: skip
            snapshot = engine.lora.cache.snapshot()
            loads[keep], resident[keep] = snapshot["loads"], snapshot["resident"]
        finally:
            engine.shutdown()
    assert loads == {True: 1, False: len(prompts)}
    assert resident[False] == [] and resident[True] == [name]
    assert got[False] == got[True]
