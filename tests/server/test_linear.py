"""toppings.server.linear.Linear against F.linear: packed (oneDNN) and plain paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toppings.server.linear import Linear, packing_works

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 77])
@pytest.mark.parametrize("pack", [True, False])
def test_matches_f_linear(dtype, rows, pack):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 72, generator=gen).to(dtype)
    x = torch.randn(rows, 72, generator=gen).to(dtype)
    linear = Linear(weight.clone(), pack)
    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, 200)
    want = F.linear(x.float(), weight.float())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 10)
    # A strided input (a column slice, as after a split) gives the same rows.
    wide = torch.cat([x, torch.zeros(rows, 8, dtype=dtype)], dim=1)[:, :72]
    torch.testing.assert_close(linear(wide), got, rtol=0, atol=0)


def test_packs_where_onednn_is_there():
    """The fast path is taken on a CPU with oneDNN; without it, or asked not to, it is not."""
    weight = torch.randn(16, 8)
    assert Linear(weight).is_packed == torch.backends.mkldnn.is_available()
    assert packing_works(torch.float32) == torch.backends.mkldnn.is_available()
    assert not Linear(weight, pack=False).is_packed
