"""gemv_bf16_tiles (server/native/csrc/gemv_tiles.c): the weight's tile layout, the product at
1-32 rows against float64 F.linear, its refusals, `Linear` on it, and oneDNN's own AMX products
run beside it on the same thread (each configures the tile unit for itself)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toppings.server import native
from toppings.server.model import linear as linear_module
from toppings.server.model.dtype import cpu_flags
from toppings.server.model.linear import GemvKernel, Linear, pack_tiles

TILES = GemvKernel("gemv_bf16_tiles", 32, 32, tiled=True)


def tiles_in_torch(weight: torch.Tensor) -> torch.Tensor:
    """The layout of gemv_tiles.c's doc, made with torch: [out/16 blocks][in/32 tiles][16 pairs]
    [16 rows][2]."""
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features // 16, 16, in_features // 32, 16, 2)  # blk n kb r e
    return blocks.permute(0, 2, 3, 1, 4).reshape(out_features, in_features)


def needs_library():
    if native.library() is None:
        pytest.skip("no native library here")


def tiles_run_here() -> bool:
    """Whether gemv_bf16_tiles runs here (it declines without AMX or the kernel's permission)."""
    x = torch.randn(1, 32).bfloat16()
    return linear_module._gemv(x, pack_tiles(torch.randn(16, 32).bfloat16()), TILES) is not None


def needs_tiles():
    needs_library()
    if "amx_bf16" not in cpu_flags():
        pytest.skip("no AMX here")
    if not tiles_run_here():
        pytest.skip("the kernel declined: no permission for the tiles (Linux before 5.16)")


@pytest.mark.parametrize("shape", [(16, 32), (208, 96), (960, 576)])
def test_pack_tiles_is_the_layout_of_the_doc(shape):
    needs_library()
    weight = torch.randn(shape).bfloat16()
    packed = pack_tiles(weight)
    assert packed.shape == weight.shape and packed.dtype == torch.bfloat16
    assert torch.equal(packed, tiles_in_torch(weight))


@pytest.mark.parametrize("shape", [(200, 96), (208, 80), (8, 32)])
def test_pack_tiles_refuses_shapes_off_the_tiles(shape):
    needs_library()
    with pytest.raises(ValueError, match="no tiles"):
        pack_tiles(torch.randn(shape).bfloat16())
    with pytest.raises(ValueError, match="no tiles"):
        pack_tiles(torch.randn(208, 96))  # float32


@pytest.mark.parametrize("shape", [(16, 32), (208, 96), (576, 1536), (3072, 576)])
def test_every_row_count_matches_float64(shape):
    """1-32 rows, strided x and y; 208 outputs: three groups of four blocks and one of one at
    up to 16 rows, six pairs of blocks and one alone past them."""
    needs_tiles()
    gen = torch.Generator().manual_seed(shape[0])
    weight = (torch.randn(shape, generator=gen) * 0.05).bfloat16()
    packed = pack_tiles(weight)
    for rows in range(1, 33):
        wide = torch.randn(rows, shape[1] + 32, generator=gen).bfloat16()
        x = wide[:, : shape[1]]  # rows strided
        y_wide = torch.full((rows, shape[0] + 16), 7.0, dtype=torch.bfloat16)
        y = y_wide[:, : shape[0]]
        failed = native.library().gemv_bf16_tiles(
            x.data_ptr(), x.stride(0), packed.data_ptr(), shape[0], shape[1], y.data_ptr(),
            y.stride(0), rows, 2,
        )  # fmt: skip
        assert failed == 0
        want = F.linear(x.double(), weight.double())
        torch.testing.assert_close(y.double(), want, rtol=2**-7, atol=2e-3)
        assert torch.equal(y_wide[:, shape[0] :], torch.full((rows, 16), 7.0).bfloat16())
        assert torch.equal(y, linear_module._gemv(x.contiguous(), packed, TILES))


def test_refusals_write_nothing():
    needs_tiles()
    weight = torch.randn(32, 64).bfloat16()
    packed = pack_tiles(weight)
    lib = native.library()
    for rows, out_features, in_features in [(33, 32, 64), (0, 32, 64), (2, 24, 64), (2, 32, 48)]:
        x = torch.randn(max(rows, 1), 64).bfloat16()
        y = torch.zeros(max(rows, 1), 32, dtype=torch.bfloat16)
        failed = lib.gemv_bf16_tiles(x.data_ptr(), 64, packed.data_ptr(), out_features,
                                     in_features, y.data_ptr(), 32, rows, 1)  # fmt: skip
        assert failed != 0
        assert not y.any()


def test_linear_runs_its_tiles_up_to_32_rows_and_onednn_past_them():
    needs_tiles()
    assert linear_module.gemv_kernel(torch.bfloat16) == TILES
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(208, 96, generator=gen) * 0.05).bfloat16()
    linear = Linear(weight.clone(), pack=True, plain_gemv=True)
    assert linear.gemv_tiled and linear.gemv_rows == 32
    assert torch.equal(linear.gemv_weight, tiles_in_torch(weight))
    for rows in (1, 4, 16, 17, 32, 33, 64):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        want = F.linear(x.double(), weight.double())
        torch.testing.assert_close(linear(x).double(), want, rtol=2**-7, atol=2e-3)
    unpacked = Linear(weight.clone(), pack=False, plain_gemv=True)  # F.linear reads the weight
    x = torch.randn(20, 96, generator=gen).bfloat16()
    assert torch.equal(unpacked(x), F.linear(x, weight))


def test_onednn_products_beside_the_tiles_on_one_thread():
    """oneDNN's bf16 products past 32 rows run on AMX where it has it; alternating them with the
    tiles' kernel on this thread, each gives what it gives alone."""
    needs_tiles()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_beside(torch.Generator().manual_seed(4))
    finally:
        torch.set_num_threads(threads)


def check_beside(gen: torch.Generator) -> None:
    weight = (torch.randn(576, 576, generator=gen) * 0.05).bfloat16()
    linear = Linear(weight.clone(), pack=True, plain_gemv=True)
    rows = [torch.randn(n, 576, generator=gen).bfloat16() for n in (8, 24, 256)]
    alone = [linear(x) for x in rows]
    for _ in range(3):
        for x, y in zip(rows[::-1], alone[::-1]):
            assert torch.equal(linear(x), y)
