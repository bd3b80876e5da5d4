"""toppings.server.model.linear.Linear against F.linear: packed (oneDNN) and plain paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toppings.server.model.linear import Linear, packing_works

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


@pytest.mark.parametrize("rows", [1, 2, 4, 5])  # 5: past the GEMV bound, the packed path
def test_bf16_gemv_matches_f_linear(rows):
    from toppings.server import native
    from toppings.server.model.dtype import cpu_flags
    from toppings.server.model.linear import gemv_works

    if "avx512_bf16" not in cpu_flags() or native.library() is None:
        pytest.skip("no avx512_bf16 GEMV here")
    assert gemv_works()  # built and checked against F.linear at start-up
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(208, 96, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    linear = Linear(weight.clone(), pack=True, plain_gemv=True)
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 208)
    want = F.linear(x.float(), weight.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-1)
    wide = torch.cat([x, torch.zeros(rows, 32, dtype=x.dtype)], dim=1)[:, :96]  # strided rows
    torch.testing.assert_close(linear(wide), got, rtol=0, atol=0)
    with pytest.raises((ValueError, RuntimeError)):  # a row of the wrong width is refused
        linear(torch.zeros(1, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 2, 4, 5])  # 5: past the GEMV bound, the packed path
def test_f32_gemv_matches_f_linear(rows):
    """The float32 GEMV (80 inputs: two 32-column steps and a 16-column tail) against float64,
    closer than the float32 product's own rounding allows oneDNN."""
    from toppings.server import native
    from toppings.server.model.dtype import cpu_flags
    from toppings.server.model.linear import gemv_works

    if "avx512f" not in cpu_flags() or native.library() is None:
        pytest.skip("no AVX-512 float32 GEMV here")
    assert gemv_works(torch.float32)
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(208, 80, generator=gen)
    x = torch.randn(rows, 80, generator=gen)
    linear = Linear(weight.clone(), pack=True, plain_gemv=True)
    assert linear.gemv_weight is not None  # the GEMV's copy is kept
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 208)
    want = F.linear(x.double(), weight.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    wide = torch.cat([x, torch.zeros(rows, 16)], dim=1)[:, :80]  # strided rows
    torch.testing.assert_close(linear(wide), got, rtol=0, atol=0)
    with pytest.raises((ValueError, RuntimeError)):  # a row of the wrong width is refused
        linear(torch.zeros(1, 64))


@pytest.mark.parametrize(
    "shape, dtype",
    [((208, 72), torch.bfloat16), ((200, 96), torch.bfloat16), ((208, 72), torch.float32),
     ((200, 96), torch.float32), ((208, 96), torch.float64)],
)  # fmt: skip
def test_no_plain_copy_where_the_gemv_cannot_run(shape, dtype):
    """72 inputs (not 32 | in for bf16, not 16 | in for float32), 200 outputs (not 16 | out),
    float64 (no GEMV): oneDNN's path only."""
    linear = Linear(torch.randn(*shape).to(dtype), pack=True, plain_gemv=True)
    assert linear.gemv_weight is None
    assert linear(torch.randn(2, shape[1]).to(dtype)).shape == (2, shape[0])


def test_the_plain_weight_copy_is_kept_only_where_memory_affords_it():
    from toppings.server.model.linear import plain_copy_affordable

    assert plain_copy_affordable(1 << 20)
    assert not plain_copy_affordable(1 << 50)  # a petabyte: no host has a quarter of it spare
