"""Triton prefill kernels (a segment of tokens per request): BGMV and MBGMV with tl.dot tiles.

Same two-step plan as decode, over token tiles of a segment. Shrink, grid (M, B, S): program
(m, b, s) takes tile m of segment b (BLOCK_M tokens) and writes the partial
h_s = x[tile, K_s] @ lora_a[rows_b, K_s].T into a float32 workspace [S, T, W] (W: the rank bound
rounded up to 16). Expand,
grid (M, B, H_out / BLOCK_N): sums the partials and adds scale_b * h @ lora_b[rows_b, n-block]
into y. M = cdiv(T, BLOCK_M) bounds every segment's tile count without reading seg_starts on the
host; tiles past the end of their segment return at once.

BGMV multiplies one tile of max(16, next_pow2(max_rank)) rows (masked beyond r: never loaded);
MBGMV steps through its own r rows RANK_CHUNK at a time (16 is tl.dot's smallest tile).

Which variant a launch compiles is `plan`'s key, from which the launcher takes its constexprs;
`variants` lists every key an engine can reach (gpu_lora/kernels/variants.py says why). BLOCK_M
follows the tokens per segment in power-of-two buckets (16, 32, 64), so it is one of three.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from toppings.gpu_lora.kernels.checks import check_prefill
from toppings.gpu_lora.kernels.triton_decode import (
    MAX_SPLITS,
    RANK_CHUNK,
    TARGET_PROGRAMS,
    check_launch,
    lora_jit,
    rank_bound,
)
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


@lora_jit
def _shrink_kernel(
    h_ptr, x_ptr, a_ptr, seg_starts_ptr, offsets_ptr, ranks_ptr, max_rank,
    H_in, k_per_split, stride_x, stride_a, stride_hs, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PADDED: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(1)
    split = tl.program_id(2)
    m0 = tl.load(seg_starts_ptr + seg).to(tl.int32) + tl.program_id(0) * BLOCK_M
    end = tl.load(seg_starts_ptr + seg + 1).to(tl.int32)
    # Clamped so a rank above the caller's bound can never write past the workspace.
    rank = tl.minimum(tl.load(ranks_ptr + seg).to(tl.int32), max_rank)
    if (m0 >= end) | (rank == 0):
        return
    off = tl.load(offsets_ptr + seg).to(tl.int64)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, H_in)
    tokens = m0 + tl.arange(0, BLOCK_M)
    tok_ok = tokens < end
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x  # [BLOCK_M, 1]
    h_rows = h_ptr + split * stride_hs + tokens.to(tl.int64)[:, None] * stride_ht
    if PADDED:
        num_rows = BLOCK_R
    else:
        num_rows = rank
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < rank
        a_cols = a_ptr + (off + rows)[None, :] * stride_a  # [1, BLOCK_R]: A^T tile columns
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            xt = tl.load(x_rows + ks[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            if UPCAST:
                xt, at = xt.to(tl.float32), at.to(tl.float32)
            acc = tl.dot(xt, at, acc, input_precision="ieee")  # [BLOCK_M, BLOCK_R]
        tl.store(h_rows + rows[None, :], acc, mask=tok_ok[:, None] & row_ok[None, :])


@lora_jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, seg_starts_ptr, offsets_ptr, ranks_ptr, scales_ptr, max_rank,
    H_out, num_splits, stride_y, stride_b, stride_hs, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PADDED: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(1)
    m0 = tl.load(seg_starts_ptr + seg).to(tl.int32) + tl.program_id(0) * BLOCK_M
    end = tl.load(seg_starts_ptr + seg + 1).to(tl.int32)
    # Clamped so a rank above the caller's bound can never write past the workspace.
    rank = tl.minimum(tl.load(ranks_ptr + seg).to(tl.int32), max_rank)
    if (m0 >= end) | (rank == 0):
        return
    off = tl.load(offsets_ptr + seg).to(tl.int64)
    scale = tl.load(scales_ptr + seg)
    tokens = m0 + tl.arange(0, BLOCK_M)
    tok_ok = tokens < end
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H_out
    h_rows = h_ptr + tokens.to(tl.int64)[:, None] * stride_ht  # [BLOCK_M, 1]
    if PADDED:
        num_rows = BLOCK_R
    else:
        num_rows = rank
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < rank
        h_mask = tok_ok[:, None] & row_ok[None, :]
        h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for s in range(0, num_splits):
            h += tl.load(h_rows + s * stride_hs + rows[None, :], mask=h_mask, other=0.0)
        b_ptrs = b_ptr + (off + rows)[:, None] * stride_b + cols[None, :]
        bt = tl.load(b_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # [R, N]
        # h goes to the pool's dtype so 16-bit pools use tensor cores; the sum stays float32.
        hb = h.to(bt.dtype)
        if UPCAST:
            hb, bt = hb.to(tl.float32), bt.to(tl.float32)
        acc = tl.dot(hb, bt, acc, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    y_ptrs = y_ptr + tokens.to(tl.int64)[:, None] * stride_y + cols[None, :]
    y_mask = tok_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=y_mask)


class Plan(NamedTuple):
    """A launch's variant and its runtime values: token tiles, the split-K count, the K slice of
    each split and the workspace's columns."""

    key: VariantKey
    num_tiles: int
    splits: int
    k_per_split: int
    width: int


@functools.lru_cache(maxsize=4096)
def plan(
    operands: Operands, index_dtypes: tuple[torch.dtype, ...], max_rank: int, padded: bool,
    num_tokens: int, num_segments: int, upcast: bool,
) -> Plan:  # fmt: skip
    """The variant a prefill launch compiles and how it tiles: operands of x, y and the pool,
    index_dtypes of (seg_starts, offsets, ranks), the rank bound (> 0), BGMV or not, T tokens in
    B segments (T >= B > 0), upcast: the interpreter's float32 dot for bfloat16."""
    h_in, h_out = operands.h_in, operands.h_out
    block_m = min(64, max(16, next_pow2(num_tokens // num_segments)))
    block_r = max(16, next_pow2(max_rank)) if padded else RANK_CHUNK
    block_k = max(16, min(next_pow2(h_in), 64 if block_r >= 64 else 128))
    num_tiles = triton.cdiv(num_tokens, block_m)
    splits = min(
        MAX_SPLITS,
        triton.cdiv(h_in, block_k),
        triton.cdiv(TARGET_PROGRAMS, num_tiles + num_segments),
    )
    k_per_split = triton.cdiv(triton.cdiv(h_in, splits), block_k) * block_k
    splits = triton.cdiv(h_in, k_per_split)
    block_n = max(16, min(next_pow2(h_out), 64 if block_r >= 64 else 128))
    width = workspace_width(max_rank)
    key = VariantKey(
        "prefill", padded, dtype_name(operands.dtype), tuple(map(dtype_name, index_dtypes)),
        block_m, block_r, block_k, block_n, upcast,
        spec_of(operands, k_per_split, width, num_tokens),
    )  # fmt: skip
    return Plan(key, num_tiles, splits, k_per_split, width)


def variants(space: LaunchSpace) -> dict[VariantKey, Launch]:
    """Every variant the prefill kernels compile in `space`, each with a launch reaching it."""
    found: dict[VariantKey, Launch] = {}
    for launch in space.launches(prefill=True):
        ops = launch.operands
        upcast = _upcast(space.device, ops.dtype)
        key = plan(
            ops, (launch.index_dtype,) * 3, launch.max_rank, space.padded, launch.num_tokens,
            launch.num_segments, upcast,
        ).key  # fmt: skip
        found.setdefault(key, launch)
    return found


def _upcast(device: str, dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bfloat16 tiles as raw integers in tl.dot; feed it float32."""
    return device == "cpu" and dtype == torch.bfloat16


def _launch(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank, padded) -> None:
    check_launch(y, x, lora_a, lora_b)
    num_tokens, num_segments = x.shape[0], offsets.shape[0]
    if num_tokens == 0 or num_segments == 0 or max_rank <= 0:
        return
    seg_starts, offsets = seg_starts.contiguous(), offsets.contiguous()
    ranks, scales = ranks.contiguous(), scales.contiguous()
    operands = Operands.of(y, x, lora_a, lora_b)
    upcast = _upcast(x.device.type, x.dtype)
    index_dtypes = (seg_starts.dtype, offsets.dtype, ranks.dtype)
    p = plan(operands, index_dtypes, max_rank, padded, num_tokens, num_segments, upcast)
    key, splits, width = p.key, p.splits, p.width
    h = torch.empty(splits, num_tokens, width, dtype=torch.float32, device=y.device)
    _shrink_kernel[(p.num_tiles, num_segments, splits)](
        h, x, lora_a, seg_starts, offsets, ranks, max_rank,
        operands.h_in, p.k_per_split, operands.stride_x, operands.stride_a,
        num_tokens * width, width,
        BLOCK_M=key.block_m, BLOCK_R=key.block_r, BLOCK_K=key.block_k, PADDED=padded,
        UPCAST=upcast,
    )  # fmt: skip
    _expand_kernel[(p.num_tiles, num_segments, triton.cdiv(operands.h_out, key.block_n))](
        y, h, lora_b, seg_starts, offsets, ranks, scales, max_rank,
        operands.h_out, splits, operands.stride_y, operands.stride_b, num_tokens * width, width,
        BLOCK_M=key.block_m, BLOCK_R=key.block_r, BLOCK_N=key.block_n, PADDED=padded,
        UPCAST=upcast,
    )  # fmt: skip


def bgmv_prefill(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    seg_starts: torch.Tensor, offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
    max_rank: int,
) -> None:  # fmt: skip
    """BGMV prefill in Triton: y[t] += scales[b] * (x[t] @ A_b.T) @ B_b per segment b, in place.

    Semantics (full: `gpu_lora.kernels.reference.bgmv_prefill`):
        for t in seg_starts[b]:seg_starts[b + 1]: A_b, B_b = rows offsets[b]:offsets[b] + ranks[b]
        every token is computed over max_rank rows, rows past ranks[b] masked to zero

    Args: y [T, H_out] (in place), x [T, H_in], lora_a [C, H_in], lora_b [C, H_out], all one of
    float32/bfloat16/float16; seg_starts [B + 1], offsets, ranks [B] int32/int64; scales [B]
    float32; max_rank int >= max(ranks) (unchecked: no device sync).
    """
    check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    _launch(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank, padded=True)


def mbgmv_prefill(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    seg_starts: torch.Tensor, offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
    max_rank: int | None = None,
) -> None:  # fmt: skip
    """MBGMV prefill in Triton: y[t] += scales[b] * (x[t] @ A_b.T) @ B_b per segment b, in place.

    Semantics (full: `gpu_lora.kernels.reference.mbgmv_prefill`):
        for t in seg_starts[b]:seg_starts[b + 1]: A_b, B_b = rows offsets[b]:offsets[b] + ranks[b]
        every token is computed over exactly its own ranks[b] rows

    Args: y [T, H_out] (in place), x [T, H_in], lora_a [C, H_in], lora_b [C, H_out], all one of
    float32/bfloat16/float16; seg_starts [B + 1], offsets, ranks [B] int32/int64; scales [B]
    float32; max_rank optional int >= max(ranks); it sizes the workspace, and
    without it the launcher reads max(ranks) from the device (a sync on CUDA).
    """
    check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    bound = rank_bound(ranks, max_rank)
    _launch(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, bound, padded=False)
