"""MBGMV over runs of one adapter's tokens in one native call: the CPU engine's LoRA (MBGMV).

A CPU decode step has few tokens per adapter, so the torch segment kernel's two small matmuls
per run cost more in dispatch than in arithmetic (16 runs x 3 projections x 30 layers are 1440
pairs a step). `lora_runs` in `csrc/lora.c` does every run of a projection in one call,
reading each token's own adapter rows only, in blocks of 4 tokens spread over the threads. It
serves prefill too: measured here (2 threads, bf16, q_proj shapes), one 128-token prompt at rank
8 took 0.05 ms against the torch kernel's 0.21, at rank 64 0.17 against 0.28, and 16 runs of
512 tokens (ranks 8-64) 4.5 ms against 5.6. Same signature and semantics as
`gpu_lora.kernels.reference.mbgmv_prefill` (tests/server/test_native_lora.py checks it against
that reference); BGMV keeps the torch kernels, whose zero-padding is its cost model.
"""

from __future__ import annotations

import ctypes

import torch

from toppings.gpu_lora.kernels import get_kernels
from toppings.gpu_lora.kernels.checks import check_prefill
from toppings.server import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def available(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES and native.library() is not None


def mbgmv_runs(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    seg_starts: torch.Tensor, offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
    max_rank: int | None = None,
) -> None:  # fmt: skip
    """y[t] += scales[b] * (x[t] @ A_b.T) @ B_b for the tokens t of each run b, in place.

    Args as `mbgmv_prefill`: y [T, H_out], x [T, H_in] (rows may be strided), lora_a [C, H_in],
    lora_b [C, H_out], one of float32/bfloat16; seg_starts [B + 1], offsets, ranks [B]; scales
    [B] float32; max_rank unused (each token runs at its own rank).
    """
    check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    lib = native.library()
    meta = [
        t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
        for t in (seg_starts, offsets, ranks)
    ]
    if (
        lib is None
        or y.dtype not in _DTYPES
        or y.stride(-1) != 1
        or x.stride(-1) != 1
        or not (lora_a.is_contiguous() and lora_b.is_contiguous() and scales.is_contiguous())
    ):
        get_kernels("cpu").mbgmv_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks,
                                         scales, max_rank)  # fmt: skip
        return
    starts, offs, rks = meta
    failed = lib.lora_runs(
        ctypes.c_void_p(x.data_ptr()), x.stride(0), ctypes.c_void_p(y.data_ptr()), y.stride(0),
        ctypes.c_void_p(lora_a.data_ptr()), ctypes.c_void_p(lora_b.data_ptr()),
        lora_a.shape[1], lora_b.shape[1], lora_a.shape[0], y.shape[0],
        ctypes.c_void_p(starts.data_ptr()), ctypes.c_void_p(offs.data_ptr()),
        ctypes.c_void_p(rks.data_ptr()), ctypes.c_void_p(scales.data_ptr()),
        offsets.shape[0], _DTYPES[y.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if failed == 2:
        raise ValueError("seg_starts, offsets or ranks point outside y or the pool")
    if failed:
        raise MemoryError("lora_runs could not allocate its buffers")
