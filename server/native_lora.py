"""MBGMV over runs of one adapter's tokens in one native call: the CPU engine's LoRA (MBGMV).

A CPU decode step has few tokens per adapter, so the torch segment kernel's two small matmuls
per run cost more in dispatch than in arithmetic (16 runs x 3 projections x 30 layers are 1440
pairs a step). `lora_runs` in `csrc/lora.c` does every run of every projection that shares an
input (q, k and v) in one call, reading each token's own adapter rows only, in blocks of 4
tokens spread over the threads. It serves prefill too: measured here (2 threads, bf16, q_proj
shapes), one 128-token prompt at rank 8 took 0.05 ms against the torch kernel's 0.21, at rank 64
0.17 against 0.28, and 16 runs of 512 tokens (ranks 8-64) 4.5 ms against 5.6. Same semantics as
`gpu_lora.kernels.reference.mbgmv_prefill` (tests/server/test_native_lora.py checks it against
that reference); BGMV keeps the torch kernels, whose zero-padding is its cost model.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from toppings.gpu_lora.kernels import get_kernels
from toppings.gpu_lora.kernels.checks import check_prefill, check_shapes
from toppings.server import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

# (y, lora_a, lora_b, ranks): one projection of a call; y [T, H_out] (rows may be strided),
# lora_a [C, H_in], lora_b [C, H_out] contiguous, ranks [B] int32 (0: the run skips it).
Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class LoraProj(ctypes.Structure):
    """One projection of a `lora_runs` call: the C struct of csrc/lora.c, field for field."""

    _fields_ = [
        ("A", ctypes.c_void_p),
        ("Bt", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("ranks", ctypes.c_void_p),
        ("ld_y", ctypes.c_int64),
        ("H_out", ctypes.c_int64),
        ("pool_rows", ctypes.c_int64),
    ]


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
    mbgmv_runs_multi(x, [(y, lora_a, lora_b, ranks)], seg_starts, offsets, scales)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _native_ok(x: torch.Tensor, projections: Sequence[Projection], scales: torch.Tensor) -> bool:
    return (
        x.dtype in _DTYPES
        and x.stride(-1) == 1
        and scales.is_contiguous()
        and all(
            y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
            for y, a, b, _ in projections
        )
    )


def mbgmv_runs_multi(
    x: torch.Tensor, projections: Sequence[Projection], seg_starts: torch.Tensor,
    offsets: torch.Tensor, scales: torch.Tensor,
) -> None:  # fmt: skip
    """`mbgmv_runs` for every projection that reads x, in one native call, in place.

    Semantics: for (y, lora_a, lora_b, ranks) in projections:
        mbgmv_runs(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)

    Args: x [T, H_in]; projections as `Projection` (their shapes and dtypes are checked here,
    the runs by the kernel, which refuses any outside y or the pool);
    seg_starts [B + 1], offsets [B] int32/int64; scales [B] float32. Off the native path (no
    compiler, other dtypes or layouts) each projection runs the torch segment kernel.
    """
    for y, a, b, _ in projections:  # what the kernel cannot see: rows of y beyond x's, widths
        check_shapes(y, x, a, b)
    lib = native.library()
    if lib is None or not _native_ok(x, projections, scales):
        prefill = get_kernels("cpu").mbgmv_prefill
        for y, a, b, ranks in projections:
            prefill(y, x, a, b, seg_starts, offsets, ranks, scales, None)
        return
    starts, offs = _int32(seg_starts), _int32(offsets)
    ranks = [_int32(r) for _, _, _, r in projections]  # kept alive through the call
    procs = (LoraProj * len(projections))(*(
        LoraProj(a.data_ptr(), b.data_ptr(), y.data_ptr(), r.data_ptr(), y.stride(0),
                 y.shape[1], a.shape[0])
        for (y, a, b, _), r in zip(projections, ranks)
    ))  # fmt: skip
    failed = lib.lora_runs(
        ctypes.c_void_p(x.data_ptr()), x.stride(0), x.shape[1], x.shape[0], procs,
        len(projections), ctypes.c_void_p(starts.data_ptr()), ctypes.c_void_p(offs.data_ptr()),
        ctypes.c_void_p(scales.data_ptr()), offsets.shape[0], _DTYPES[x.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    if failed == 2:
        raise ValueError("seg_starts, offsets or ranks point outside y or the pool")
    if failed:
        raise MemoryError("lora_runs could not allocate its buffers")
