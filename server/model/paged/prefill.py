"""Prefill and mixed-step attention over the token-level KV pool in Triton: every segment of a
step in one launch per layer, its keys and values read by slot inside the kernel.

On the torch path each segment is its own SDPA call (after a cached past or earlier chunks: a
gathered copy of the past and an explicit mask, no flash kernel), one chain per segment and
layer. Here the step's keys and values are already in the pool (the model writes them before
attention), so a segment of t tokens after a past of P slots is one list of P + t slots, and
token j of it attends causally to the first P + j + 1: a whole prompt, a chunk after its
earlier chunks or a cached prefix, and a mixed step's decode rows (t = 1) alike.

Grid (tiles, K): a tile is up to `tile_tokens` consecutive tokens of one segment times the
G = N / K query heads of kv head kh, packed as the rows of one tl.dot tile of BLOCK_R rows
(row r: token r // G, head r % G), so each key block read serves every query head of its group.
It walks the segment's slots up to its last token's position in blocks of BLOCK_N with online
softmax in float32. The table of tiles is built once a step (`plan_paged`) and serves every
layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch
import triton
import triton.language as tl

from toppings.server.memory.past_table import PastTable
from toppings.server.model.paged.decode import LOG2E, attend_block, check_launch, upcast

BLOCK_R = 64  # query rows (tokens x heads of one kv group) of a tile
BLOCK_N = 64  # slots per step of a tile's loop
# Fields of a row of the tile table: the segment's first token in the step, its new tokens t,
# where its slot list starts in `index`, its past P, the tile's first token in the segment.
SEG_START, SEG_LEN, INDEX_START, PAST, TILE_START = range(5)


@dataclass
class PagedPrefill:
    """A prefill or mixed step as the Triton kernel attends it, built once a step.

    index: the segments' slot lists one after another, each its past then its own new tokens;
    tiles: one row per tile (the fields above); tile_tokens: tokens per tile.
    """

    index: torch.Tensor  # [S] int64, on the device
    tiles: torch.Tensor  # [num_tiles, 5] int64, on the device
    tile_tokens: int


def plan_paged(
    seg_starts: list[int], past_slots: list[torch.Tensor | None] | None, slots: torch.Tensor,
    group: int,
) -> PagedPrefill:  # fmt: skip
    """The plan of a step whose T tokens went to `slots` [T] int64 (segment i is tokens
    seg_starts[i]:seg_starts[i + 1], after the slots past_slots[i] [P] of its past, or none),
    for a model of `group` query heads per kv head."""
    tile_tokens = max(1, BLOCK_R // group)
    if isinstance(past_slots, PastTable):
        return _plan_from_table(seg_starts, past_slots, tile_tokens)
    pieces, rows, offset = [], [], 0  # one cat of every piece: one launch, not one a segment
    for i, (start, end) in enumerate(zip(seg_starts[:-1], seg_starts[1:])):
        past = past_slots[i] if past_slots is not None else None
        num_past = 0 if past is None else past.numel()
        pieces += [slots[start:end]] if past is None else [past, slots[start:end]]
        rows += [
            (start, end - start, offset, num_past, j) for j in range(0, end - start, tile_tokens)
        ]
        offset += num_past + end - start
    index = torch.cat(pieces) if pieces else slots.new_zeros(0)
    tiles = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5).to(slots.device, non_blocking=True)
    return PagedPrefill(index, tiles, tile_tokens)


def _plan_from_table(seg_starts: list[int], past: PastTable, tile_tokens: int) -> PagedPrefill:
    """plan_paged's plan, the same, built by array operations over the step's segments (not a
    slice and a cat each: a mixed step beside hundreds of decodes)."""
    seg = numpy.asarray(seg_starts, dtype=numpy.int64)
    t = numpy.diff(seg)  # [S] new tokens
    p = numpy.asarray(past.starts, dtype=numpy.int64)  # [S] past
    offsets = numpy.cumsum(p + t) - (p + t)  # where each segment's slots start in the index
    counts = -(-t // tile_tokens)  # [S] tiles of each segment
    of = numpy.repeat(numpy.arange(len(t)), counts)  # [tiles] each tile's segment
    first = numpy.arange(len(of), dtype=numpy.int64) - (numpy.cumsum(counts) - counts)[of]
    rows = numpy.stack([seg[:-1][of], t[of], offsets[of], p[of], first * tile_tokens], axis=1)
    tiles = torch.from_numpy(rows).to(past.table.device, non_blocking=True)  # [tiles, 5]
    return PagedPrefill(past.spans(t), tiles, tile_tokens)


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, index_ptr, tiles_ptr, qk_scale, tile_tokens, G, D,
    stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_ot,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kh = tl.program_id(1)
    row = tiles_ptr + tile * 5
    seg_start = tl.load(row + 0).to(tl.int32)
    seg_len = tl.load(row + 1).to(tl.int32)
    index_start = tl.load(row + 2)  # int64
    past = tl.load(row + 3).to(tl.int32)
    tile_start = tl.load(row + 4).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    j = tile_start + r // G  # [BLOCK_R] token of each row in its segment
    row_ok = (r < tile_tokens * G) & (j < seg_len)
    d_ok = d < D
    heads = kh * G + r % G
    toks = (seg_start + j).to(tl.int64)
    q_ptrs = q_ptr + toks[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    last = past + j  # [BLOCK_R] the last position each row attends
    hi = past + tl.minimum(tile_start + tile_tokens, seg_len)  # past the tile's last token
    k_base = k_ptr + kh.to(tl.int64) * stride_kh
    v_base = v_ptr + kh.to(tl.int64) * stride_vh
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):  # block 0 holds position 0: every row's m is finite
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        slots = tl.load(index_ptr + index_start + cols, mask=col_ok, other=0).to(tl.int64)
        causal = col_ok[None, :] & (cols[None, :] <= last[:, None])
        acc, m, l_sum = attend_block(  # [BLOCK_R, BLOCK_D], [BLOCK_R], [BLOCK_R]
            q, acc, m, l_sum, k_base, v_base, slots, d, d_ok, col_ok, causal,
            stride_ks, stride_vs, qk_scale, UPCAST,
        )  # fmt: skip
    acc = acc / l_sum[:, None]
    o_ptrs = out_ptr + toks[:, None] * stride_ot + heads[:, None] * D + d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PagedPrefill
) -> torch.Tensor:
    """Causal attention of every segment of a step over its past and its own keys in the pool.

    Semantics (reference: `attention.prefill_attention` without a plan, one SDPA per segment):
        for segment i (tokens s:e, t = e - s, past P, its list L = index[o:o + P + t]),
            token s + j, head h (kv head kh = h // G):
            p = softmax(q[s + j, h] . k_cache[kh, L[:P + j + 1]].T / sqrt(D))   (float32)
            out[s + j, h] = p.to(dtype) @ v_cache[kh, L[:P + j + 1]]

    Args: q [T, N, D] (rows may be strided, stride 1 along D); k_cache, v_cache [K, S, D] (one
    layer of the pool, holding this step's keys and values already), all float32, bfloat16 or
    float16; plan: `plan_paged` of this step, for G = N / K. Returns [T, N*D] in q's dtype.
    """
    num_tokens, n, d = q.shape
    group = check_launch(q, k_cache, v_cache)
    if group * plan.tile_tokens > max(BLOCK_R, triton.next_power_of_2(group)):
        raise ValueError(f"a plan of {plan.tile_tokens} tokens a tile, for another group")
    out = torch.empty(num_tokens, n * d, dtype=q.dtype, device=q.device)
    num_tiles = plan.tiles.shape[0]
    if num_tiles == 0:
        return out
    block_r = max(BLOCK_R, triton.next_power_of_2(group))
    _prefill_kernel[(num_tiles, k_cache.shape[0])](
        out, q, k_cache, v_cache, plan.index, plan.tiles, d**-0.5 * LOG2E, plan.tile_tokens,
        group, d, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0),
        BLOCK_R=block_r, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=BLOCK_N,
        UPCAST=upcast(q),
    )  # fmt: skip
    return out
