"""torch's CPU int4 pack dequantized in one native pass (csrc/dequant_int4.c), for a prompt's
rows: quant.QuantizedLinear multiplies them by the float weight through torch's GEMM, and
unpacking the pack with torch's ops (nibbles, concatenation, transpose, then subtract, multiply
and add, each a pass over the slice) cost more than the GEMM at a few hundred rows.

The result is W.T, [in, rows], the pack's own order: `x @ dequantize_int4_pack(...)` is
F.linear(x, W).
"""

from __future__ import annotations

import ctypes

import torch

from toppings.server import native
from toppings.server.model.quant_gemv import INT4_GROUP

INT4_BLOCK_ROWS = 64  # the CPU int4 pack's block of output rows: [out / 64, in, 32] bytes


def dequantize_int4_pack(
    packed: torch.Tensor, sz: torch.Tensor, in_features: int, start: int, stop: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:  # fmt: skip
    """Output rows start:stop of a packed int4 weight as W.T [in, stop - start] in `dtype`
    (float32 or bfloat16): (q - 8) * scale + zero in float32 as torch's ops round it (no fused
    multiply-add), rounded once to `dtype`. packed: `_convert_weight_to_int4pack_for_cpu`'s
    [padded, in / 2] uint8 (padded a multiple of 64); sz [in / 32, padded, 2] (scale, zero) in
    float32 or bfloat16; start a multiple of 64, stop a multiple of 64 or the last row. None
    where the native library is absent or declines."""
    lib = native.library()
    padded = packed.shape[0]
    if (
        lib is None
        or dtype not in (torch.float32, torch.bfloat16)
        or sz.dtype not in (torch.float32, torch.bfloat16)
        or not (packed.is_contiguous() and sz.is_contiguous())
        or packed.shape[1] * 2 != in_features
        or sz.shape != (in_features // INT4_GROUP, padded, 2)
        or start % INT4_BLOCK_ROWS
        or not 0 <= start < stop <= padded
    ):
        return None
    first, last = start // INT4_BLOCK_ROWS, -(-stop // INT4_BLOCK_ROWS)
    wt = torch.empty(in_features, (last - first) * INT4_BLOCK_ROWS, dtype=dtype)
    failed = lib.dequant_int4_pack(
        ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(sz.data_ptr()),
        int(sz.dtype == torch.bfloat16), in_features, padded, first, last,
        ctypes.c_void_p(wt.data_ptr()), int(dtype == torch.bfloat16), wt.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        return None
    return wt[:, : stop - start]
