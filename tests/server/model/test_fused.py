"""The native elementwise ops of a layer against their torch versions (the reference)."""

from __future__ import annotations

import pytest
import torch

from toppings.gpu_lora.kernels import native_build
from toppings.server import native
from toppings.server.model import fused

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler here")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 300])  # 300 x 96: rows split across threads
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("hidden", [96, 40])  # 96: the vectorized rows (16 | H); 40: scalar
def test_add_rms_norm(dtype, num_tokens, with_delta, hidden):
    wide = rand(num_tokens, 160, dtype=dtype)  # h is a strided view of it, as in the model
    h, delta = wide[:, :hidden], rand(num_tokens, hidden, dtype=dtype, seed=1)
    weight = rand(hidden, dtype=dtype, seed=2)
    h_ref = h.clone()
    if with_delta:
        h_ref += delta
    want = fused.rms_norm_torch(h_ref, weight, 1e-5)
    got = fused.add_rms_norm(h, delta if with_delta else None, weight, 1e-5)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)  # the residual add rounds alike
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 1200])
@pytest.mark.parametrize("d", [16, 64])  # 64: the vectorized path (16 | D / 2); 16: scalar
def test_rope_in_place_on_strided_heads(dtype, num_tokens, d):
    qkv = rand(num_tokens, 5 * d, dtype=dtype)  # 3 rotated heads + 2 untouched
    cos, sin = rand(num_tokens, d, dtype=dtype, seed=1), rand(num_tokens, d, dtype=dtype, seed=2)
    heads = qkv[:, : 3 * d].view(num_tokens, 3, d)
    want = fused.rope_torch(heads.clone(), cos, sin)
    untouched = qkv[:, 3 * d :].clone()
    fused.rope_(heads, cos, sin)
    torch.testing.assert_close(qkv[:, : 3 * d].view(num_tokens, 3, d), want, rtol=TOL[dtype],
                               atol=TOL[dtype])  # fmt: skip
    assert torch.equal(qkv[:, 3 * d :], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 9, 700])  # 700 x 96: rows split across threads
@pytest.mark.parametrize("inter", [96, 24])  # 24: not a multiple of 16, the torch path
def test_silu_mul(dtype, num_tokens, inter):
    wide = rand(num_tokens, 2 * inter + 8, dtype=dtype) * 4  # gate_up a strided view
    gate_up = wide[:, : 2 * inter]
    want = fused.silu_mul_torch(gate_up.clone())
    got = fused.silu_mul(gate_up)
    assert got.shape == (num_tokens, inter) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_torch_path_where_native_is_off(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    h, weight = rand(4, 8, dtype=torch.float32), rand(8, dtype=torch.float32, seed=1)
    want = fused.rms_norm_torch(h, weight, 1e-5)
    assert torch.equal(fused.add_rms_norm(h, None, weight, 1e-5), want)


def cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_the_avx2_build_is_the_avx512_builds_bit_for_bit(tmp_path, monkeypatch, dtype):
    """What an AVX2-only CPU runs (the library built with -mno-avx512f) gives the same bits as
    the AVX-512 build, over the whole range: large and small gates, results that underflow to
    subnormals and zero, overflow, infinities and NaN."""
    if not {"avx512f", "avx2", "fma"} <= cpu_flags():
        pytest.skip("needs a CPU that runs both builds")
    monkeypatch.setenv("TOPPINGS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TOPPINGS_NATIVE_CFLAGS", "-mno-avx512f")
    avx2 = native_build.load("avx2_kernels", native.CSRC, native.SOURCES, native.HEADERS,
                             native.SIGNATURES, fallback="none")  # fmt: skip
    assert avx2 is not None
    special = [0.0, -0.0, 1e-30, -1e-30, 88.0, 89.0, -88.0, -89.0, -103.9, -104.0, -150.0, 104.0,
               150.0, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]  # fmt: skip
    gate = torch.cat(
        [torch.tensor(special), rand(3 * 1024 - len(special), dtype=torch.float32) * 30]
    )
    gate = torch.cat([gate, torch.linspace(-110, 110, 1024)]).to(dtype)  # 4,096 values
    gate_up = torch.cat([gate, rand(gate.numel(), dtype=dtype) * 3]).view(1, -1)
    inter = gate.numel()
    outs = []
    for lib in (native.library(), avx2):
        out = torch.empty(1, inter, dtype=dtype)
        failed = lib.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), 1, inter,
                              fused.NATIVE_DTYPES[dtype], 1)  # fmt: skip
        assert failed == 0
        outs.append(out)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(outs[0].view(bits), outs[1].view(bits))
