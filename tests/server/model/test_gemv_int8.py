"""The native int8 and int4 GEMVs (csrc/gemv_int8.c, csrc/gemv_int4_bf16.c, quant_gemv.py) and
the AVX2 + FMA float32 / bf16 GEMVs beside them, against float torch references: every ISA
variant this machine runs (AVX-512, AVX2 + FMA, plain C), float32 and bfloat16 activations, 1-4
rows, SmolLM2's shapes, the shapes they must decline, and builds of the library without AVX-512
(as on an AVX2-only AMD EPYC) and without AVX2, which this CPU runs as well."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tests.server.model.test_gemv_tiles import tiles_run_here
from toppings.gpu_lora.kernels import native_build
from toppings.gpu_lora.kernels.native_build import Status
from toppings.server import native
from toppings.server.model import linear as linear_module
from toppings.server.model import quant, quant_gemv
from toppings.server.model.dtype import cpu_flags
from toppings.server.model.linear import Linear
from toppings.server.model.quant import QuantizedLinear, quantize_int4, quantize_int8
from toppings.server.model.quant_gemv import int4_gemv, int4_gemv_layout, int8_gemv

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native library here")

# [out, in]: SmolLM2's o_proj, gate (1536), down, lm_head; and 80 inputs (a 16-column tail)
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (48, 80)]
# bfloat16 rounds the output once: half an ulp of bf16 relative
BF16_RTOL = 2**-8


def isas() -> list[str]:
    flags = cpu_flags()
    found = ["c"]
    if "avx2" in flags and "fma" in flags:
        found.append("avx2")
    if "avx512f" in flags:
        found.append("avx512")
    return [*found, "best"]


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ (q * scales).T in float64."""
    return F.linear(x.double(), q.double() * scales.double()[:, None])


def check_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:  # float32 sums of up to 1536 products
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # the float32 sum rounded once to bfloat16
        torch.testing.assert_close(got.double(), want, rtol=BF16_RTOL, atol=1e-3)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isas())
def test_int8_gemv_matches_the_dequantized_product(shape, dtype, isa):
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = quantize_int8(torch.randn(shape, generator=gen) * 0.05)
    scales = weight.scales.to(dtype).float()  # the scales as a `dtype` model keeps them
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        got = int8_gemv(x, weight.q, scales, isa)
        assert got is not None and got.dtype == dtype and got.shape == (rows, out_features)
        check_close(got, reference(x, weight.q, scales), dtype)
        # strided rows (a column slice, as after a split) give the same values
        wide = torch.cat([x, torch.ones(rows, 16, dtype=dtype)], dim=1)[:, :in_features]
        assert torch.equal(int8_gemv(wide, weight.q, scales, isa), got)


@pytest.mark.parametrize(
    "shape, rows, dtype",
    [((200, 96), 1, torch.float32), ((208, 72), 1, torch.float32), ((208, 8), 1, torch.float32),
     ((208, 96), 5, torch.float32), ((208, 96), 1, torch.float16)],
)  # fmt: skip
def test_int8_gemv_declines_what_it_does_not_take(shape, rows, dtype):
    """200 outputs (not 16 | out), 72 or 8 inputs (not 16 | in, or under 16), 5 rows (past
    GEMV_ROWS), float16 activations: None, and QuantizedLinear takes torch's path for them."""
    weight = quantize_int8(torch.randn(shape))
    x = torch.randn(rows, shape[1]).to(dtype)
    for isa in isas():
        assert int8_gemv(x, weight.q, weight.scales, isa) is None
    linear = QuantizedLinear(weight, dtype)
    if shape[0] % 16 or shape[1] % 16 or dtype == torch.float16:
        assert linear.gemv_rows == 0
    want = F.linear(x.float(), weight.dequantize(dtype))
    torch.testing.assert_close(linear(x).float(), want, rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_runs_the_gemv_at_one_to_four_rows(dtype, monkeypatch):
    """int8 at 1-4 rows goes through the native GEMV, with the bias added; 5 rows do not."""
    if not quant.int8_gemv_works(dtype):
        pytest.skip("the native int8 GEMV does not run here")
    calls = []
    gemv = quant.int8_gemv

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return gemv(x, *args, **kwargs)

    monkeypatch.setattr(quant, "int8_gemv", counted)
    gen = torch.Generator().manual_seed(5)
    weight = quantize_int8(torch.randn(3072, 576, generator=gen))
    bias = torch.randn(3072, generator=gen).to(dtype)
    linear = QuantizedLinear(weight, dtype, bias)
    assert linear.gemv_rows == 4
    for rows in (1, 3, 4, 5):
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        want = F.linear(x.double(), weight.dequantize(dtype).double(), bias.double())
        if dtype == torch.float32:
            check_close(linear(x), want, dtype)
        else:  # the product rounded to bfloat16, then the bias added in bfloat16: two roundings
            atol = float(want.abs().max()) * 2**-8
            torch.testing.assert_close(linear(x).double(), want, rtol=2**-7, atol=atol)
    assert calls == [1, 3, 4]


# int4: 96 inputs are 3 groups of 32
INT4_SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (48, 96)]


@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isas())
def test_int4_gemv_matches_the_dequantized_product(shape, dtype, isa):
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = quantize_int4(torch.randn(shape, generator=gen) * 0.05)
    layout = int4_gemv_layout(weight, dtype)
    plain = weight.dequantize(dtype).double()  # scales and zeros as kept in `dtype`
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        got = int4_gemv(x, *layout, isa)
        assert got is not None and got.dtype == dtype and got.shape == (rows, out_features)
        check_close(got, F.linear(x.double(), plain), dtype)
        wide = torch.cat([x, torch.ones(rows, 16, dtype=dtype)], dim=1)[:, :in_features]
        assert torch.equal(int4_gemv(wide, *layout, isa), got)


@pytest.mark.parametrize(
    "shape, rows, dtype",
    [((200, 96), 1, torch.float32), ((208, 96), 5, torch.float32), ((208, 96), 1, torch.float16)],
)  # fmt: skip
def test_int4_gemv_declines_what_it_does_not_take(shape, rows, dtype):
    """200 outputs (not 16 | out), 5 rows, float16: None, and torch's paths in QuantizedLinear
    (int4 refuses inputs that are not groups of 32 at quantization: test_quant.py)."""
    weight = quantize_int4(torch.randn(shape))
    x = torch.randn(rows, shape[1]).to(dtype)
    layout = int4_gemv_layout(weight, torch.float32)
    for isa in isas():
        assert int4_gemv(x, *layout, isa) is None
    linear = QuantizedLinear(weight, dtype)
    if shape[0] % 16 or dtype == torch.float16:
        assert linear.gemv_rows == 0
    want = F.linear(x.float(), weight.dequantize(dtype))
    torch.testing.assert_close(linear(x).float(), want, rtol=2e-3, atol=2e-2)


def test_bfloat16_int4_takes_the_bf16_gemv_where_it_runs():
    """bfloat16 int4 runs the AVX512_BF16 GEMV where it works here, else torch's kernel (which ran
    one stream faster than `int4_gemv`: quant.gemv_rows)."""
    weight = quantize_int4(torch.randn(64, 64))
    want = 4 if quant_gemv.int4_bf16_gemv_works() else 0
    assert QuantizedLinear(weight, torch.bfloat16).gemv_rows == want


@pytest.mark.parametrize("shape", INT4_SHAPES + [(32, 32), (64, 160)])
def test_int4_bf16_gemv_matches_the_dequantized_product(shape):
    """The bf16 GEMV (vdpbf16ps against 128 + q, corrected per group) against float64 on the
    weight as a bfloat16 model keeps it; 1-4 rows; a row stride wider than the row; 1 and 5
    groups (the masked last block of four)."""
    if not {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_flags():
        pytest.skip("no AVX512_BF16 here")
    assert quant_gemv.int4_bf16_gemv_works()
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = quantize_int4(torch.randn(shape, generator=gen) * 0.05)
    layout = quant_gemv.int4_bf16_gemv_layout(weight)
    plain = weight.dequantize(torch.bfloat16).double()
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        got = quant_gemv.int4_bf16_gemv(x, *layout)
        assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        check_close(got, F.linear(x.double(), plain), torch.bfloat16)
        wide = torch.cat([x, torch.ones(rows, 16, dtype=torch.bfloat16)], dim=1)[:, :in_features]
        assert torch.equal(quant_gemv.int4_bf16_gemv(wide, *layout), got)
    assert quant_gemv.int4_bf16_gemv(torch.randn(5, in_features).bfloat16(), *layout) is None
    assert quant_gemv.int4_bf16_gemv(torch.randn(1, in_features), *layout) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_runs_the_int4_gemv_at_one_to_four_rows(dtype, monkeypatch):
    name = "int4_gemv" if dtype == torch.float32 else "int4_bf16_gemv"
    works = quant.int4_gemv_works(dtype) if dtype == torch.float32 else quant.int4_bf16_gemv_works()
    if not works:
        pytest.skip("the native int4 GEMV does not run here")
    calls = []
    gemv = getattr(quant, name)

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return gemv(x, *args, **kwargs)

    monkeypatch.setattr(quant, name, counted)
    gen = torch.Generator().manual_seed(8)
    weight = quantize_int4(torch.randn(200 + 8, 576, generator=gen))
    linear = QuantizedLinear(weight, dtype)
    assert linear.gemv_rows == 4
    for rows in (1, 4, 5):
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        check_close(linear(x), F.linear(x.double(), weight.dequantize(dtype).double()), dtype)
    assert calls == [1, 4]
    linear.gemv_rows = 0  # torch's int4 paths give the same product
    want = F.linear(x[:1].double(), weight.dequantize(dtype).double())
    torch.testing.assert_close(linear(x[:1]).double(), want, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_float_gemv_matches_f_linear(shape, dtype):
    """gemv_f32_avx2 / gemv_bf16_avx2 (which any AVX2 + FMA CPU runs) against float64."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no AVX2 + FMA here")
    name = "gemv_f32_avx2" if dtype == torch.float32 else "gemv_bf16_avx2"
    kernel = linear_module.GemvKernel(name, 16, 4)
    gen = torch.Generator().manual_seed(shape[0])
    weight = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, shape[1], generator=gen).to(dtype)
        got = linear_module._gemv(x, weight, kernel)
        assert got is not None and got.dtype == dtype
        check_close(got, F.linear(x.double(), weight.double()), dtype)
    assert linear_module._gemv(torch.randn(5, shape[1]).to(dtype), weight, kernel) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_the_avx2_gemv_where_the_avx512_ones_are_missing(dtype, monkeypatch):
    """With only the AVX2 kernels listed (an AVX2-only CPU's case), gemv_kernel picks them, a
    plain-copy Linear keeps its copy, and its 1-4 rows run them."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no AVX2 + FMA here")
    avx2_only = {k: tuple(v for v in kernels if "avx2" in v[0]) for k, kernels in _gemv_table()}
    monkeypatch.setattr(linear_module, "_GEMV", avx2_only)
    linear_module.gemv_kernel.cache_clear()
    try:
        assert linear_module.gemv_kernel(dtype)[0].endswith("_avx2")
        gen = torch.Generator().manual_seed(6)
        weight = torch.randn(208, 80, generator=gen).to(dtype)  # 80: not 32 | in, 16 | in
        linear = Linear(weight.clone(), pack=True, plain_gemv=True)
        assert linear.gemv_weight is not None
        x = torch.randn(3, 80, generator=gen).to(dtype)
        check_close(linear(x), F.linear(x.double(), weight.double()), dtype)
    finally:
        linear_module.gemv_kernel.cache_clear()


def _gemv_table():
    return linear_module._GEMV.items()


def test_the_avx512_kernels_come_first_where_the_cpu_has_them():
    flags = cpu_flags()
    if "avx512f" in flags:
        assert linear_module.gemv_kernel(torch.float32).name == "gemv_f32"
    if "avx512_bf16" in flags:  # the tiles first where they run (AMX, Linux 5.16 on)
        tiles = "amx_bf16" in flags and tiles_run_here()
        want = "gemv_bf16_tiles" if tiles else "gemv_bf16"
        assert linear_module.gemv_kernel(torch.bfloat16).name == want


def build_without(tmp_path, flags: list[str]) -> ctypes.CDLL:
    """linear.c, gemv_tiles.c, gemv_int8.c and gemv_int4_bf16.c built as the library is, plus
    `flags` (an older ISA)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    out = tmp_path / "gemv.so"
    names = ("linear.c", "gemv_tiles.c", "gemv_int8.c", "gemv_int4_bf16.c")
    sources = [str(native.CSRC / s) for s in names]
    subprocess.run(
        [compiler, *native_build.FLAGS, *flags, f"-I{native_build.INCLUDE_DIR}", *sources,
         "-o", str(out), "-lm"],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lib = ctypes.CDLL(str(out))
    for function, argtypes in native.SIGNATURES.items():
        if function.startswith("gemv"):
            fn = getattr(lib, function)
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def call_float(lib, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    failed = getattr(lib, name)(
        x.data_ptr(), x.stride(0), weight.data_ptr(), weight.shape[0], weight.shape[1],
        y.data_ptr(), y.stride(0), x.shape[0], 2,
    )  # fmt: skip
    return None if failed else y


def call_int8(lib, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, isa: int):
    y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
    failed = lib.gemv_int8(
        x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), q.data_ptr(),
        scales.data_ptr(), q.shape[0], q.shape[1], y.data_ptr(), y.stride(0), x.shape[0], isa, 2,
    )  # fmt: skip
    return None if failed else y


def call_int4(lib, x, packed, scales, offsets):
    y = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
    failed = lib.gemv_int4(
        x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), packed.data_ptr(),
        scales.data_ptr(), offsets.data_ptr(), packed.shape[0], x.shape[1], y.data_ptr(),
        y.stride(0), x.shape[0], 0, 2,
    )  # fmt: skip
    return None if failed else y


@pytest.mark.parametrize("build", ["avx2", "plain"])
def test_builds_without_avx512_run_and_match(tmp_path, build):
    """The library built with -mno-avx512f (what -march=native gives on an AVX2-only EPYC): the
    AVX-512 GEMVs (the AMX one too) decline, the AVX2 ones and the int8 GEMV's best (AVX2) match
    float64; built also without AVX2 / FMA: the int8 GEMV's best is plain C, the float GEMVs all
    decline."""
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU cannot run the AVX2 build")
    lib = build_without(
        tmp_path, ["-mno-avx512f"] if build == "avx2" else ["-mno-avx2", "-mno-fma"]
    )
    gen = torch.Generator().manual_seed(7)
    for out_features, in_features in [(1536, 576), (576, 1536), (48, 96)]:
        weight = quantize_int8(torch.randn(out_features, in_features, generator=gen) * 0.05)
        plain = weight.dequantize()
        for dtype in (torch.float32, torch.bfloat16):
            scales = weight.scales.to(dtype).float()
            for rows in (1, 3, 4):
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                w4 = quantize_int4(plain)
                layout = int4_gemv_layout(w4, dtype)
                y4 = call_int4(lib, x, *layout)
                check_close(y4, F.linear(x.double(), w4.dequantize(dtype).double()), dtype)
                best = call_int8(lib, x, weight.q, scales, quant_gemv.GEMV_ISA["best"])
                check_close(best, reference(x, weight.q, scales), dtype)
                assert call_int8(lib, x, weight.q, scales, quant_gemv.GEMV_ISA["avx512"]) is None
                avx2 = call_int8(lib, x, weight.q, scales, quant_gemv.GEMV_ISA["avx2"])
                assert (avx2 is not None) == (build == "avx2")
                w = plain.to(dtype)
                avx512_name = "gemv_f32" if dtype == torch.float32 else "gemv_bf16"
                assert call_float(lib, avx512_name, x, w) is None
                if dtype == torch.bfloat16:  # the tiles' kernel needs AVX-512 too
                    assert call_float(lib, "gemv_bf16_tiles", x, w) is None
                name = "gemv_f32_avx2" if dtype == torch.float32 else "gemv_bf16_avx2"
                got = call_float(lib, name, x, w)
                if build == "plain":
                    assert got is None
                else:
                    check_close(got, F.linear(x.double(), w.double()), dtype)
        x = torch.randn(1, in_features, generator=gen).bfloat16()
        packed, pairs = quant_gemv.int4_bf16_gemv_layout(quantize_int4(plain))
        y = torch.empty(1, out_features, dtype=torch.bfloat16)
        declined = lib.gemv_int4_bf16(
            ctypes.c_void_p(x.data_ptr()), in_features, ctypes.c_void_p(packed.data_ptr()),
            ctypes.c_void_p(pairs.data_ptr()), out_features, in_features,
            ctypes.c_void_p(y.data_ptr()), out_features, 1, 1,
        )  # fmt: skip
        assert declined == Status.DECLINED  # the bf16 int4 GEMV needs AVX-512 (AVX512_BF16)
