"""Triton decode kernels (one token per request): BGMV and MBGMV as a shrink then an expand.

Shrink, grid (B, S): program (i, s) computes the partial h_s[i] = lora_a[rows_i, K_s] @ x[i, K_s]
over its slice K_s of H_in (split-K), so that even B = 1 spreads the read of the adapter's A over
S programs. Expand, grid (B, H_out / BLOCK_N): program (i, n) sums the S partials into h[i] and
adds scale_i * h[i] @ lora_b[rows_i, n-block] into y. A single fused kernel per (token, H_out
block) would recompute the shrink, re-reading all of A, once per H_out block.

BGMV works on one constexpr tile of next_pow2(max_rank) rows per token with rows >= r masked, so
its arithmetic grows with max_rank (Punica's padding) while the masked rows are never loaded (they
may hold NaN or lie past the pool). MBGMV loops over its own r rows in chunks of RANK_CHUNK.
All math is float32; partials live in a float32 workspace [S, B, W], W the rank bound rounded up
to 16. A rank above the max_rank bound breaks the contract; the kernels clamp it (wrong numbers,
never a write past the workspace) because checking it would cost a device sync.

Which variant a launch compiles is `plan`'s key, from which the launcher takes its constexprs;
`variants` lists every key an engine can reach (gpu_lora/kernels/variants.py says why).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from toppings.gpu_lora.kernels.checks import check_decode
from toppings.gpu_lora.kernels.variants import (
    Launch,
    LaunchSpace,
    Operands,
    VariantKey,
    dtype_name,
    next_pow2,
    spec_of,
    workspace_width,
)

RANK_CHUNK = 16  # MBGMV rows per step (and the smallest tile tl.dot accepts in prefill)
TILE_ELEMS = 4096  # elements of one [rows, cols] weight tile: bounds registers per program
TARGET_PROGRAMS = 256  # shrink programs worth launching: a few per SM of an H100/H200
MAX_SPLITS = 16
# Values that change from step to step are not specialized, so that they never make a variant:
# the rank bound and the split count (ints), and the index pointers (read one scalar at a time).
VARYING = ("max_rank", "num_splits")
INDEX_POINTERS = ("offsets_ptr", "ranks_ptr", "scales_ptr", "seg_starts_ptr")


def lora_jit(fn):
    """triton.jit, less the specializations that VARYING and INDEX_POINTERS name."""
    names = set(fn.__code__.co_varnames[: fn.__code__.co_argcount])
    return triton.jit(
        fn,
        do_not_specialize=[n for n in VARYING if n in names],
        do_not_specialize_on_alignment=[n for n in INDEX_POINTERS if n in names],
    )


@lora_jit
def _shrink_kernel(
    h_ptr, x_ptr, a_ptr, offsets_ptr, ranks_ptr, max_rank,
    H_in, k_per_split, stride_x, stride_a, stride_hs, stride_ht,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PADDED: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    split = tl.program_id(1)
    # Clamped so a rank above the caller's bound can never write past the workspace.
    rank = tl.minimum(tl.load(ranks_ptr + tok).to(tl.int32), max_rank)
    if rank == 0:
        return
    off = tl.load(offsets_ptr + tok).to(tl.int64)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, H_in)
    x_row = x_ptr + tok.to(tl.int64) * stride_x
    h_row = h_ptr + split * stride_hs + tok * stride_ht
    if PADDED:
        num_rows = BLOCK_R
    else:
        num_rows = rank
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < rank
        a_rows = a_ptr + (off + rows)[:, None] * stride_a  # [BLOCK_R, 1]
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            xv = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)  # [BLOCK_R]
        tl.store(h_row + rows, acc, mask=row_ok)


@lora_jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, offsets_ptr, ranks_ptr, scales_ptr, max_rank,
    H_out, num_splits, stride_y, stride_b, stride_hs, stride_ht,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PADDED: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    n_block = tl.program_id(1)
    # Clamped so a rank above the caller's bound can never write past the workspace.
    rank = tl.minimum(tl.load(ranks_ptr + tok).to(tl.int32), max_rank)
    if rank == 0:
        return
    off = tl.load(offsets_ptr + tok).to(tl.int64)
    scale = tl.load(scales_ptr + tok)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H_out
    h_row = h_ptr + tok * stride_ht
    if PADDED:
        num_rows = BLOCK_R
    else:
        num_rows = rank
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < rank
        h = tl.zeros([BLOCK_R], dtype=tl.float32)
        for s in range(0, num_splits):
            h += tl.load(h_row + s * stride_hs + rows, mask=row_ok, other=0.0)
        b_ptrs = b_ptr + (off + rows)[:, None] * stride_b + cols[None, :]
        b = tl.load(b_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # [R, N]
        acc += tl.sum(h[:, None] * b.to(tl.float32), axis=0)  # [BLOCK_N]
    y_ptrs = y_ptr + tok.to(tl.int64) * stride_y + cols
    y = tl.load(y_ptrs, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=col_ok)


def check_launch(*tensors: torch.Tensor) -> None:
    """Triton needs unit stride along the hidden dim, and interpret mode for CPU tensors."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(
                f"Triton LoRA kernels need stride 1 along the last dim, got {t.stride()}"
            )
    if tensors[0].device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 before import")


def rank_bound(ranks: torch.Tensor, max_rank: int | None) -> int:
    """The caller's bound on ranks, else the actual max (a device-to-host sync on CUDA)."""
    if max_rank is not None:
        return max_rank
    return int(ranks.max()) if ranks.numel() else 0


class Plan(NamedTuple):
    """A launch's variant and its runtime values: the split-K count, the K slice of each split
    and the workspace's columns."""

    key: VariantKey
    splits: int
    k_per_split: int
    width: int


@functools.lru_cache(maxsize=4096)
def plan(
    operands: Operands, index_dtypes: tuple[torch.dtype, ...], max_rank: int, padded: bool,
    num_tokens: int,
) -> Plan:  # fmt: skip
    """The variant a decode launch compiles and how it splits: operands of x, y and the pool,
    index_dtypes of (offsets, ranks), the rank bound (> 0), BGMV or not, B tokens (> 0)."""
    h_in, h_out = operands.h_in, operands.h_out
    block_r = next_pow2(max_rank) if padded else RANK_CHUNK
    block_k = min(next_pow2(h_in), max(32, TILE_ELEMS // block_r))
    splits = min(MAX_SPLITS, triton.cdiv(h_in, block_k), triton.cdiv(TARGET_PROGRAMS, num_tokens))
    k_per_split = triton.cdiv(triton.cdiv(h_in, splits), block_k) * block_k
    splits = triton.cdiv(h_in, k_per_split)
    block_n = min(next_pow2(h_out), max(32, TILE_ELEMS // block_r))
    width = workspace_width(max_rank)
    key = VariantKey(
        "decode", padded, dtype_name(operands.dtype), tuple(map(dtype_name, index_dtypes)),
        0, block_r, block_k, block_n, False, spec_of(operands, k_per_split, width, num_tokens),
    )  # fmt: skip
    return Plan(key, splits, k_per_split, width)


def variants(space: LaunchSpace) -> dict[VariantKey, Launch]:
    """Every variant the decode kernels compile in `space`, each with a launch that reaches it."""
    found: dict[VariantKey, Launch] = {}
    for launch in space.launches(prefill=False):
        dtypes = (launch.index_dtype,) * 2
        key = plan(launch.operands, dtypes, launch.max_rank, space.padded, launch.num_tokens).key
        found.setdefault(key, launch)
    return found


def _launch(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank: int, padded: bool) -> None:
    check_launch(y, x, lora_a, lora_b)
    num_tokens = x.shape[0]
    if num_tokens == 0 or max_rank <= 0:
        return
    offsets, ranks, scales = offsets.contiguous(), ranks.contiguous(), scales.contiguous()
    operands = Operands.of(y, x, lora_a, lora_b)
    p = plan(operands, (offsets.dtype, ranks.dtype), max_rank, padded, num_tokens)
    key, splits, width = p.key, p.splits, p.width
    h = torch.empty(splits, num_tokens, width, dtype=torch.float32, device=y.device)
    _shrink_kernel[(num_tokens, splits)](
        h, x, lora_a, offsets, ranks, max_rank,
        operands.h_in, p.k_per_split, operands.stride_x, operands.stride_a,
        num_tokens * width, width,
        BLOCK_R=key.block_r, BLOCK_K=key.block_k, PADDED=padded,
    )  # fmt: skip
    _expand_kernel[(num_tokens, triton.cdiv(operands.h_out, key.block_n))](
        y, h, lora_b, offsets, ranks, scales, max_rank,
        operands.h_out, splits, operands.stride_y, operands.stride_b, num_tokens * width, width,
        BLOCK_R=key.block_r, BLOCK_N=key.block_n, PADDED=padded,
    )  # fmt: skip


def bgmv_decode(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor, max_rank: int,
) -> None:  # fmt: skip
    """BGMV decode in Triton: y[i] += scales[i] * (x[i] @ A_i.T) @ B_i per token, in place.

    Semantics (full: `gpu_lora.kernels.reference.bgmv_decode`):
        A_i, B_i = lora_a[offsets[i]:offsets[i] + ranks[i]], lora_b[same rows]; ranks[i] == 0: skip
        every token is computed over max_rank rows, rows past ranks[i] masked to zero

    Args: y [B, H_out] (in place), x [B, H_in], lora_a [C, H_in], lora_b [C, H_out], all one of
    float32/bfloat16/float16; offsets, ranks [B] int32/int64; scales [B] float32;
    max_rank int >= max(ranks) (unchecked: no device sync).
    """
    check_decode(y, x, lora_a, lora_b, offsets, ranks, scales)
    _launch(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank, padded=True)


def mbgmv_decode(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor, max_rank: int | None = None,
) -> None:  # fmt: skip
    """MBGMV decode in Triton: y[i] += scales[i] * (x[i] @ A_i.T) @ B_i per token, in place.

    Semantics (full: `gpu_lora.kernels.reference.mbgmv_decode`):
        A_i, B_i = lora_a[offsets[i]:offsets[i] + ranks[i]], lora_b[same rows]; ranks[i] == 0: skip
        every token is computed over exactly its own ranks[i] rows

    Args: y [B, H_out] (in place), x [B, H_in], lora_a [C, H_in], lora_b [C, H_out], all one of
    float32/bfloat16/float16; offsets, ranks [B] int32/int64; scales [B] float32;
    max_rank optional int >= max(ranks); it sizes the workspace, and
    without it the launcher reads max(ranks) from the device (a sync on CUDA).
    """
    check_decode(y, x, lora_a, lora_b, offsets, ranks, scales)
    bound = rank_bound(ranks, max_rank)
    _launch(y, x, lora_a, lora_b, offsets, ranks, scales, bound, padded=False)
