"""The native elementwise ops of a layer against their torch versions (the reference)."""

from __future__ import annotations

import pytest
import torch

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
