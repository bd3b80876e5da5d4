"""The engine's native GEMVs over quantized weights (csrc/gemv_int8.c, csrc/gemv_int4_bf16.c):
a decode step's 1-4 rows (`GEMV_ROWS`) times a weight-only int8 or int4 weight, each weight row
read once for all rows. `quant.QuantizedLinear` calls them where `quant.gemv_rows` says they run
(and decode_path.py hands their layouts to the one-call decode step); each returns None where it
declines (no native library, a shape, dtype or ISA it does not take), and each `*_works` check
runs it once against F.linear before the engine relies on it.

- `int8_gemv`: float32 or bfloat16 activations, values and scales as `quant.Int8Weight`.
- `int4_gemv`: float32 (or bfloat16) activations, the weight dequantized in float32 registers:
  `int4_gemv_layout`.
- `int4_bf16_gemv`: bfloat16 activations on CPUs with AVX512_BF16, the weight multiplied as bf16
  (vdpbf16ps): `int4_bf16_gemv_layout` (the same packed values, scales and zeros as bf16 pairs).

`Int4Weight`, the int4 weight both int4 layouts are made from (quant.py quantizes into it), lives
here so that the `*_works` checks build one without importing quant.py (which imports this).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toppings.server import native

INT4_GROUP = 32  # inputs of a group that shares a scale and a zero


@dataclass
class Int4Weight:
    """q [out, in] uint8 in [0, 15], scales and zeros [out, in / INT4_GROUP] float32:
    W ~ (q - 8) * scale + zero, per group of INT4_GROUP inputs."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by in `dtype`'s model, as float32 [out, in]."""
        out_features, in_features = self.q.shape
        groups = self.q.view(out_features, -1, INT4_GROUP).float() - 8  # [out, G, 32]
        scales, zeros = (t.to(dtype).float()[..., None] for t in (self.scales, self.zeros))
        return (groups * scales + zeros).view(out_features, in_features)


GEMV_ROWS = 4  # csrc/gemv_int8.c's bound: one pass over the weight for every row
# gemv_int8's `isa` argument: native_api.h's GemvIsa (ISA_BEST ...), by its lowercase name
GEMV_ISA = {"best": 0, "avx2": 1, "c": 2, "avx512": 512}


def int8_gemv(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, isa: str = "best"
) -> torch.Tensor | None:
    """x [T, in] (float32 or bfloat16, T <= GEMV_ROWS) @ (q * scales[:, None]).T -> [T, out] in
    x's dtype, through the native int8 GEMV (csrc/gemv_int8.c); q [out, in] int8 contiguous,
    scales [out] float32. None where it declines (no native library, a shape or dtype it does
    not take, or `isa` not built here)."""
    lib = native.library()
    if (
        lib is None
        or x.dim() != 2
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.stride(-1) != 1
        or q.dtype != torch.int8
        or not q.is_contiguous()
        or scales.dtype != torch.float32
        or not scales.is_contiguous()
        or x.shape[1] != q.shape[1]
        or scales.shape != q.shape[:1]
    ):
        return None
    y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
    failed = lib.gemv_int8(
        ctypes.c_void_p(x.data_ptr()), x.stride(0), int(x.dtype == torch.bfloat16),
        ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(scales.data_ptr()), q.shape[0],
        q.shape[1], ctypes.c_void_p(y.data_ptr()), y.stride(0), x.shape[0], GEMV_ISA[isa],
        torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else y


@functools.cache
def int8_gemv_works(dtype: torch.dtype) -> bool:
    """Whether the native int8 GEMV runs here for activations in `dtype` and agrees with F.linear
    on the dequantized weight (checked once per dtype)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8)
    scales = (torch.rand(32, generator=gen) / 64).to(dtype).float()
    x = torch.randn(3, 64, generator=gen).to(dtype)
    got = int8_gemv(x, q, scales)
    want = F.linear(x.float(), q.float() * scales[:, None])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return got is not None and torch.allclose(got.float(), want, rtol=tol, atol=tol)


def int4_gemv_layout(weight: Int4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The native int4 GEMV's own copy of `weight` (csrc/gemv_int8.c, gemv_int4): the values
    [out, in / 2] uint8, a group of 32 inputs in 16 bytes (input k in the low nibble of byte k,
    input k + 16 in its high nibble); the scales and offsets [out, in / 32] float32 with
    W = scale * q + offset (offset = zero - 8 scale), scale and zero as kept in `dtype`."""
    scales = weight.scales.to(dtype).float()
    offsets = weight.zeros.to(dtype).float() - 8 * scales
    return _packed(weight.q), scales, offsets


def _packed(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] in [0, 15] as both int4 GEMVs read it: [out, in / 2] uint8, a group of 32
    inputs in 16 bytes, input k in the low nibble of byte k and input k + 16 in its high one."""
    groups = q.view(q.shape[0], -1, INT4_GROUP)  # [out, G, 32]
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(q.shape[0], -1).contiguous()


def int4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    isa: str = "best",
) -> torch.Tensor | None:
    """x [T, in] (float32 or bfloat16, T <= GEMV_ROWS) @ W.T -> [T, out] in x's dtype through
    the native int4 GEMV, W as `int4_gemv_layout` gave (packed, scales, offsets). None where it
    declines (as int8_gemv)."""
    lib = native.library()
    groups = packed.shape[1] * 2 // INT4_GROUP
    if (
        lib is None
        or x.dim() != 2
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.stride(-1) != 1
        or packed.dtype != torch.uint8
        or not packed.is_contiguous()
        or x.shape[1] != packed.shape[1] * 2
        or any(t.dtype != torch.float32 or not t.is_contiguous() for t in (scales, offsets))
        or scales.shape != (packed.shape[0], groups)
        or offsets.shape != scales.shape
    ):
        return None
    y = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
    failed = lib.gemv_int4(
        ctypes.c_void_p(x.data_ptr()), x.stride(0), int(x.dtype == torch.bfloat16),
        ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(scales.data_ptr()),
        ctypes.c_void_p(offsets.data_ptr()), packed.shape[0], x.shape[1],
        ctypes.c_void_p(y.data_ptr()), y.stride(0), x.shape[0], GEMV_ISA[isa],
        torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else y


@functools.cache
def int4_gemv_works(dtype: torch.dtype) -> bool:
    """Whether the native int4 GEMV runs here for activations in `dtype` and agrees with
    F.linear on the dequantized weight (checked once per dtype)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    weight, x = _random_int4(dtype)
    got = int4_gemv(x, *int4_gemv_layout(weight, dtype))
    want = F.linear(x.float(), weight.dequantize(dtype))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return got is not None and torch.allclose(got.float(), want, rtol=tol, atol=tol)


def int4_bf16_gemv_layout(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 int4 GEMV's copy of `weight` (csrc/gemv_int4_bf16.c): the packed values as
    `int4_gemv_layout`'s [out, in / 2] uint8, and sz [out, in / 32] int32 holding each group's
    scale (low 16 bits) and zero (high 16 bits) as bf16 bits: a bfloat16 model's scales and zeros
    are bf16 numbers, so nothing is rounded."""
    halves = [t.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
              for t in (weight.scales, weight.zeros)]  # fmt: skip
    return _packed(weight.q), (halves[0] | (halves[1] << 16)).contiguous()


def int4_bf16_gemv(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor | None:
    """x [T, in] bfloat16 (T <= GEMV_ROWS) @ W.T -> [T, out] bfloat16, W as
    `int4_bf16_gemv_layout` gave (packed, sz). None where it declines (as int8_gemv; also on a
    CPU or build without AVX512_BF16)."""
    lib = native.library()
    if (
        lib is None
        or x.dim() != 2
        or x.dtype != torch.bfloat16
        or x.stride(-1) != 1
        or packed.dtype != torch.uint8
        or not packed.is_contiguous()
        or x.shape[1] != packed.shape[1] * 2
        or sz.dtype != torch.int32
        or not sz.is_contiguous()
        or sz.shape != (packed.shape[0], x.shape[1] // INT4_GROUP)
    ):
        return None
    y = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
    failed = lib.gemv_int4_bf16(
        ctypes.c_void_p(x.data_ptr()), x.stride(0), ctypes.c_void_p(packed.data_ptr()),
        ctypes.c_void_p(sz.data_ptr()), packed.shape[0], x.shape[1],
        ctypes.c_void_p(y.data_ptr()), y.stride(0), x.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else y


@functools.cache
def int4_bf16_gemv_works() -> bool:
    """Whether the bf16 int4 GEMV runs here (AVX512_BF16 in the build and the CPU) and agrees
    with F.linear on the dequantized weight (checked once)."""
    weight, x = _random_int4(torch.bfloat16)
    got = int4_bf16_gemv(x, *int4_bf16_gemv_layout(weight))
    want = F.linear(x.float(), weight.dequantize(torch.bfloat16))
    return got is not None and torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)


def _random_int4(dtype: torch.dtype) -> tuple[Int4Weight, torch.Tensor]:
    """32 x 96 (three groups: an odd last one) and x [3, 96] in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 96), generator=gen, dtype=torch.uint8)
    scales, zeros = (torch.randn(32, 3, generator=gen) / 16 for _ in range(2))
    return Int4Weight(q, scales, zeros), torch.randn(3, 96, generator=gen).to(dtype)
