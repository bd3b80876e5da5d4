"""The native MBGMV-over-runs kernel against the float32 reference prefill kernel."""

from __future__ import annotations

import pytest
import torch

from toppings.gpu_lora.kernels import reference
from toppings.server import native, native_lora

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler here")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def case(dtype, runs, ranks, h_in=48, h_out=40, pool_rows=160, seed=0):
    """Pool rows hold NaN except where the runs' adapters sit; y is a strided view."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.full((pool_rows, h_in), float("nan"))
    lora_b = torch.full((pool_rows, h_out), float("nan"))
    offsets, off = [], 3
    for r in ranks:
        offsets.append(off)
        lora_a[off : off + r] = torch.randn(r, h_in, generator=gen) / h_in**0.5
        lora_b[off : off + r] = torch.randn(r, h_out, generator=gen)
        off += max(r, 1) + 5
    starts = [0]
    for n in runs:
        starts.append(starts[-1] + n)
    x = torch.randn(starts[-1], h_in, generator=gen).to(dtype)
    wide = torch.randn(starts[-1], h_out + 7, generator=gen).to(dtype)
    args = (
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(offsets, dtype=torch.int32),
        torch.tensor(ranks, dtype=torch.int32),
        torch.rand(len(ranks), generator=gen) * 2,
    )
    return wide[:, :h_out], x, lora_a.to(dtype), lora_b.to(dtype), args


MIXES = {
    "distinct": ([1, 1, 1, 1], [8, 16, 32, 64]),
    "uniform": ([3, 3, 3], [16, 16, 16]),
    "skewed": ([9, 1, 2], [64, 8, 0]),  # rank 0: no adapter, rows untouched
    "single": ([5], [32]),
    "empty runs": ([0, 2, 0], [8, 8, 16]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("h_out", [40, 32])  # 32: blocks of 4 tokens, vectorized (16 | H)
def test_matches_reference(dtype, mix, h_out):
    y, x, lora_a, lora_b, args = case(dtype, *MIXES[mix], h_out=h_out)
    want = y.clone()
    reference.mbgmv_prefill(want, x, lora_a, lora_b, *args)
    native_lora.mbgmv_runs(y, x, lora_a, lora_b, *args)
    torch.testing.assert_close(y.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_rows_outside_the_pool_are_refused_before_anything_is_written():
    y, x, lora_a, lora_b, (starts, offsets, ranks, scales) = case(torch.float32, [2, 2], [8, 8])
    before = y.clone()
    offsets[1] = lora_a.shape[0] - 4  # rank 8 would read past the pool
    with pytest.raises(ValueError):
        native_lora.mbgmv_runs(y, x, lora_a, lora_b, starts, offsets, ranks, scales)
    assert torch.equal(y, before)
