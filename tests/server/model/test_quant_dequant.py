"""The native dequantizer of torch's int4 pack (server/model/quant_dequant.py,
csrc/dequant_int4.c): bit for bit the weight quant.py's torch ops give, over padded rows and
slices, and the path a prompt's int4 rows take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toppings.server import native
from toppings.server.model import quant
from toppings.server.model.quant import QuantizedLinear, quantize_int4
from toppings.server.model.quant_dequant import dequantize_int4_pack

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native library here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out", "in_features"), [(200, 96), (64, 32), (576, 1536)])
def test_it_equals_the_torch_dequantization(dtype, out, in_features):
    gen = torch.Generator().manual_seed(out)
    linear = QuantizedLinear(quantize_int4(torch.randn(out, in_features, generator=gen)), dtype)
    slices = [(0, out), (64, out), (0, 64), (out // 64 * 64 - 64, out)]
    for start, stop in [(a, b) for a, b in slices if a < b]:
        wt = dequantize_int4_pack(linear._q, linear._scales, in_features, start, stop, dtype)
        assert wt is not None and wt.shape == (in_features, stop - start) and wt.dtype == dtype
        assert torch.equal(wt.T, linear.dequantize_rows(start, stop).to(dtype)), (start, stop)


def test_it_declines_what_it_does_not_take():
    linear = QuantizedLinear(quantize_int4(torch.randn(128, 64)), torch.float32)
    q, sz = linear._q, linear._scales
    assert dequantize_int4_pack(q, sz, 64, 32, 128, torch.float32) is None  # not a block start
    assert dequantize_int4_pack(q, sz, 64, 0, 192, torch.float32) is None  # past the rows
    assert dequantize_int4_pack(q, sz, 64, 0, 128, torch.float16) is None  # a dtype
    assert dequantize_int4_pack(q, sz, 96, 0, 128, torch.float32) is None  # another shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_int4_rows_take_it(dtype, monkeypatch):
    calls = []

    def counted(*args):
        calls.append(args[3:5])
        return dequantize_int4_pack(*args)

    monkeypatch.setattr(quant, "dequantize_int4_pack", counted)
    monkeypatch.setattr(quant, "DEQUANT_ROWS", 128)
    gen = torch.Generator().manual_seed(9)
    w, x = torch.randn(200, 96, generator=gen), torch.randn(40, 96, generator=gen).to(dtype)
    q = quantize_int4(w)
    linear = QuantizedLinear(q, dtype)
    assert linear.max_kernel_rows < 40
    got = linear(x)
    assert calls == [(0, 128), (128, 200)]
    want = F.linear(x, q.dequantize(dtype).to(dtype))
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
