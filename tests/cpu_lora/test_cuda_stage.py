"""CPU LoRA calls with a CUDA x (cuda_stage.py): same deltas as the reference, on the device."""

from __future__ import annotations

import pytest
import torch
from cpu_lora_helpers import QKV, reference, tiny_config

from tests.helpers import adapter_id
from toppings.cpu_lora import CpuLoraPool

SEGMENTS = [
    (adapter_id("a4"), 0, 5),
    (None, 5, 9),
    (adapter_id("b8"), 12, 25),
    (adapter_id("c16"), 25, 33),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_x_gives_device_deltas(repo, adapters, dtype):
    with CpuLoraPool(repo, tiny_config(), 2, max_tokens=64, tokens_per_core=4) as pool:
        for seed in range(3):  # consecutive calls reuse the arena: the fetch wait matters
            x = torch.randn(40, 128, generator=torch.Generator().manual_seed(seed))
            got = pool.run(1, x.to("cuda", dtype), SEGMENTS, QKV)
            want = reference(adapters, 1, x.to(dtype).float(), SEGMENTS, QKV)
            for module in QKV:
                assert got[module].device.type == "cuda" and got[module].dtype == dtype
                tol = 1e-5 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(
                    got[module].float().cpu(), want[module], rtol=tol, atol=tol
                )
            assert pool.last_call.fallbacks == 0
