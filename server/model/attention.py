"""Causal attention of one engine step: prefill segments, or one query per request in decode.

Both read keys and values in place from the token-level pool: on a CPU with the native kernels
(`native.py`), on a GPU with the Triton kernels of `paged/` (decode with flash-decoding splits;
a prefill or mixed step's segments in one launch per layer). Elsewhere (a CPU without a
compiler, or a GPU without Triton) the torch path gathers them into a dense copy first: decode
in `_decode_torch`, prefill in one SDPA per segment; it stays the reference the others are
tested against (tests/server/model/test_attention.py, test_paged_attention.py). Prefill attends
to each request's own new tokens and, when part of its prompt came from the prefix cache or
earlier chunks, to that past's keys in the pool.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy
import torch
import torch.nn.functional as F

from toppings.gpu_lora.kernels import native_build
from toppings.server import native
from toppings.server.memory.past_table import PastTable

if TYPE_CHECKING:
    from toppings.server.model.paged import PagedPrefill

log = logging.getLogger(__name__)
_NATIVE_DTYPES = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_NATIVE_DTYPES_ROWS = {torch.float32: 0, torch.bfloat16: 1}
_PAGED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Which segments the blocked kernel (`attention_tiles.c`) attends: it reads the past once per
# tile of 32 tokens, the rows kernel once per token, but a tile pays a fixed cost (its queries
# and outputs transposed) and a segment of fewer tokens is padded to one. So at least
# TILE_MIN_LEN new tokens and TILE_MIN_WORK key reads (t x (P + (t + 1) / 2)); the others (a
# decode row, a short prompt or a short chunk) go to the rows kernel. The bounds are where the
# two kernels' times cross in bench/bench_prefill_attention.py (prefill_attention.json; the
# crossings: docs/benchmarks.md, "Measurements behind the code").
TILE_MIN_LEN = 32
TILE_MIN_WORK = 16384
# On a CPU with AMX (amx_bf16), a bfloat16 segment of at least this many new tokens goes to
# torch's SDPA instead: its flash kernel runs the products on the tile unit (oneDNN's brgemm),
# the blocked kernel on vector registers. On a 2-core AMX Xeon (2 threads, SmolLM2's heads) SDPA
# took 0.50x the blocked kernel's time on a whole 2,500-token prompt, 0.75x on 512 and on 256,
# 0.77x on 256 after a past of 2,300 (gathered), 0.82x on 128, 1.13x on 64 after 600; in float32
# the blocked kernel stays 1.3-1.6x faster (prefill_attention_amx.json; docs/benchmarks.md,
# "Measurements behind the code"). Elsewhere (no AMX: an EPYC with avx512_bf16) it never does.
SDPA_MIN_LEN = 256


def sdpa_min_len(dtype: torch.dtype, device: torch.device) -> int:
    """The segment length from which a CPU prefill attends by SDPA (SDPA_MIN_LEN), 0: never."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return 0
    return SDPA_MIN_LEN if "amx_bf16" in native_build.cpu_flags() else 0


@dataclass
class PrefillPlan:
    """The prompt tokens of one prefill step as the native kernels attend them, built once a
    step.

    Every segment's slots (its cached prefix or earlier chunks, then its own tokens, in the pool
    before attention runs) lie one segment after another in `index`, but those of the segments
    in `sdpa` (long ones on a CPU where torch's SDPA is faster: SDPA_MIN_LEN), which it attends.
    Token j of a short segment (see TILE_MIN_LEN) attends to the first lengths[j] slots at
    index[row_start[j]:] (the rows kernel: t x (P + t) row reads in all); each longer segment is
    a row of `tiles` (its first token, its t new tokens, where its slots start in index, its
    past P) for the blocked kernel, and its tokens have length 0 here.
    """

    index: torch.Tensor  # [S] int64, the segments' slot lists one after another
    row_start: torch.Tensor  # [T] int64
    lengths: torch.Tensor  # [T] int64
    tiles: torch.Tensor  # [num_tiled, 4] int64: (first token, new tokens, index start, past)
    has_rows: bool  # whether any segment is short
    sdpa: list[int]  # the segments SDPA attends, their tokens of length 0 here too


@dataclass
class DecodeRows:
    """The one-token segments after a past (a mixed step's decode rows) on the torch path (a
    GPU without Triton, or a CPU without the native kernel), attended in one batched decode call
    instead of one SDPA chain per segment and layer, which left a GPU's mixed step launch bound
    (bench/GPU.md's first run; docs/benchmarks.md, "GPU")."""

    rows: torch.Tensor  # [Bd] int64, the rows' token indices in the step
    index: torch.Tensor  # [Bd, Lmax] int64, each row's past and own slot, padded
    lengths: torch.Tensor  # [Bd] int64
    segments: list[int]  # the other segments, one SDPA each


def plan_prefill(
    seg_starts: list[int],
    past_slots: list[torch.Tensor | None] | None,
    slots: torch.Tensor,
    group: int = 1,
    paged: bool = True,
    sdpa_from: int = 0,
) -> PrefillPlan | DecodeRows | PagedPrefill | None:
    """The plan of a prefill or mixed step whose tokens went to `slots` [T] int64, the same in
    every layer, for `group` query heads per kv head: every segment in one Triton launch on a
    GPU, natively attended rows on a CPU with the native kernel, else the decode rows to batch
    (None where there are fewer than two). paged: False takes the torch path on a GPU;
    sdpa_from: on a CPU, segments of at least this many new tokens go to SDPA (0: none;
    `sdpa_min_len`)."""
    kernels = _paged() if paged and slots.device.type == "cuda" else None
    if kernels is not None:
        return kernels.plan_paged(seg_starts, past_slots, slots, group)
    if slots.device.type != "cpu" or native.library() is None:
        return _plan_decode_rows(seg_starts, past_slots, slots)
    if isinstance(past_slots, PastTable):
        return _plan_from_table(seg_starts, past_slots, sdpa_from)
    num_tokens = seg_starts[-1]
    row_start = torch.zeros(num_tokens, dtype=torch.int64)
    lengths = torch.zeros(num_tokens, dtype=torch.int64)
    lists, offset, tiles, sdpa = [], 0, [], []
    for i, (start, end) in enumerate(zip(seg_starts[:-1], seg_starts[1:])):
        t = end - start
        if 0 < sdpa_from <= t:
            sdpa.append(i)
            continue
        past = past_slots[i] if past_slots is not None else None
        num_past = 0 if past is None else past.numel()
        lists.append(slots[start:end] if past is None else torch.cat([past, slots[start:end]]))
        if t >= TILE_MIN_LEN and t * (num_past + (t + 1) / 2) >= TILE_MIN_WORK:
            tiles.append((start, t, offset, num_past))
        else:
            row_start[start:end] = offset
            lengths[start:end] = torch.arange(num_past + 1, num_past + 1 + end - start)
        offset += num_past + end - start
    index = torch.cat(lists) if lists else torch.zeros(0, dtype=torch.int64)
    tiles_t = torch.tensor(tiles, dtype=torch.int64).reshape(-1, 4)
    has_rows = len(tiles) + len(sdpa) < len(seg_starts) - 1
    return PrefillPlan(index, row_start, lengths, tiles_t, has_rows, sdpa)


def _plan_from_table(seg_starts: list[int], past: PastTable, sdpa_from: int) -> PrefillPlan:
    """plan_prefill's native plan, the same, built by array operations over the step's
    segments (not a slice and a cat each: a mixed step beside hundreds of decodes)."""
    seg = numpy.asarray(seg_starts, dtype=numpy.int64)
    t = numpy.diff(seg)  # [S] new tokens
    p = numpy.asarray(past.starts, dtype=numpy.int64)  # [S] past
    sdpa = t >= sdpa_from if sdpa_from > 0 else numpy.zeros(len(t), dtype=bool)
    tiled = ~sdpa & (t >= TILE_MIN_LEN) & (t * (p + (t + 1) / 2) >= TILE_MIN_WORK)
    lengths = numpy.where(sdpa, 0, p + t)  # [S] each list's length in the index
    offsets = numpy.cumsum(lengths) - lengths
    of = numpy.repeat(numpy.arange(len(t)), t)  # [T] each token's segment
    is_row = ~(sdpa | tiled)[of]
    within = numpy.arange(seg[-1], dtype=numpy.int64) - seg[of]  # [T] position in its segment
    tiles = numpy.stack([seg[:-1], t, offsets, p], axis=1)[tiled]  # [tiles, 4]
    return PrefillPlan(
        index=past.spans(t, ~sdpa),
        row_start=torch.from_numpy(numpy.where(is_row, offsets[of], 0)),  # [T]
        lengths=torch.from_numpy(numpy.where(is_row, p[of] + 1 + within, 0)),  # [T]
        tiles=torch.from_numpy(numpy.ascontiguousarray(tiles)),
        has_rows=bool((~(sdpa | tiled)).any()),
        sdpa=numpy.flatnonzero(sdpa).tolist(),
    )


def _plan_decode_rows(seg_starts, past_slots, slots: torch.Tensor) -> DecodeRows | None:
    num_segments = len(seg_starts) - 1
    past = past_slots if past_slots is not None else [None] * num_segments
    rows = [i for i, p in enumerate(past)  # one token after a past: a decode row
            if seg_starts[i + 1] - seg_starts[i] == 1 and p is not None and p.numel()]  # fmt: skip
    if len(rows) < 2:
        return None
    lists = [torch.cat([past[i], slots[seg_starts[i] : seg_starts[i] + 1]]) for i in rows]
    device, is_row = slots.device, set(rows)
    return DecodeRows(
        rows=torch.tensor([seg_starts[i] for i in rows], dtype=torch.int64, device=device),
        index=torch.nn.utils.rnn.pad_sequence(lists, batch_first=True),
        lengths=torch.tensor([t.numel() for t in lists], dtype=torch.int64, device=device),
        segments=[i for i in range(num_segments) if i not in is_row],
    )


def prefill_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    val: torch.Tensor,
    seg_starts: list[int],
    past_slots: list[torch.Tensor | None] | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    plan: PrefillPlan | DecodeRows | PagedPrefill | None = None,
) -> torch.Tensor:
    """Causal self-attention within each segment. q [T, N, D]; key, val [T, K, D] -> [T, N*D].

    past_slots: per segment, the slots [P] of a cached prefix in k_cache, v_cache [K, S, D] (one
    layer of the pool) that its t tokens follow: they attend to those P keys and causally to
    their own. With a `PrefillPlan` (and k_cache, v_cache holding this step's keys), every
    segment runs natively, reading the pool in place: the short ones in one call of the rows
    kernel, the others in one call of the blocked kernel, but those of `plan.sdpa` (SDPA_MIN_LEN).
    SDPA's per-call cost dominates short prompts, and after a past it needs an explicit mask and
    a gathered copy of the past (bench/bench_prefill_attention.py compares the three). With a
    `PagedPrefill` (a GPU), every segment runs in one Triton launch reading the pool in place.
    With `DecodeRows`, its rows are attended as one decode batch. Inputs go to SDPA as 4-D
    [1, heads, t, D]: with 3-D ones torch's CPU SDPA falls back to its unfused math kernel (a
    large share of a prefill: docs/benchmarks.md, "Measurements behind the code") instead of its
    flash kernel.
    """
    num_tokens = q.shape[0]
    paged = _paged() if q.device.type == "cuda" else None
    if paged is not None and isinstance(plan, paged.PagedPrefill) and q.dtype in _PAGED_DTYPES:
        return paged.paged_prefill_attention(q, k_cache, v_cache, plan)
    lib = native.library() if isinstance(plan, PrefillPlan) else None
    if isinstance(plan, DecodeRows):
        out = torch.empty_like(q)  # [T, N, D]
        rows = decode_attention(q[plan.rows], k_cache, v_cache, plan.index, plan.lengths, False)
        out[plan.rows] = rows.view(-1, *q.shape[1:])
        rest = plan.segments
    elif lib is not None and q.dtype in _NATIVE_DTYPES and k_cache.is_contiguous():
        out, rest = _prefill_native(lib, q, k_cache, v_cache, plan), plan.sdpa  # [T, N, D]
    else:
        out, rest = torch.empty_like(q), range(len(seg_starts) - 1)
    for i in rest:  # one SDPA each
        start, end = seg_starts[i], seg_starts[i + 1]
        past = past_slots[i] if past_slots is not None else None
        out[start:end] = _segment(q, key, val, start, end, past, k_cache, v_cache)
    return out.reshape(num_tokens, -1)


def _segment(q, key, val, start: int, end: int, past, k_cache, v_cache) -> torch.Tensor:
    """SDPA over one segment (after a cached prefix `past` [P] of slots, or None): [t, N, D]."""
    qs = q[start:end].transpose(0, 1)[None]  # [1, N, t, D]
    ks, vs = key[start:end].transpose(0, 1), val[start:end].transpose(0, 1)  # [K, t, D]
    if past is None:
        o = F.scaled_dot_product_attention(qs, ks[None], vs[None], is_causal=True, enable_gqa=True)
    else:
        p, t = past.numel(), end - start
        ks = torch.cat([k_cache.index_select(1, past), ks], dim=1)[None]  # [1, K, P+t, D]
        vs = torch.cat([v_cache.index_select(1, past), vs], dim=1)[None]
        cols = torch.arange(p + t, device=q.device)
        mask = cols[None, :] <= (p + torch.arange(t, device=q.device))[:, None]  # [t, P+t]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)  # [t, N, D]


def _prefill_native(lib, q, k_cache, v_cache, plan: PrefillPlan) -> torch.Tensor:
    t, n, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty(t, n, d, dtype=q.dtype)
    ptrs = [ctypes.c_void_p(x.data_ptr()) for x in (q, k_cache, v_cache, out, plan.index)]
    shape = (n, k_cache.shape[0], d, k_cache.shape[1], q.stride(0), d**-0.5)
    is_bf16, threads = _NATIVE_DTYPES_ROWS[q.dtype], torch.get_num_threads()
    failed = 0
    if plan.has_rows:
        failed |= lib.attention_rows(
            *ptrs, ctypes.c_void_p(plan.row_start.data_ptr()),
            ctypes.c_void_p(plan.lengths.data_ptr()), t, *shape, is_bf16, threads,
        )  # fmt: skip
    if plan.tiles.numel():
        failed |= lib.attention_tiles(
            *ptrs, ctypes.c_void_p(plan.tiles.data_ptr()), plan.tiles.shape[0], *shape,
            is_bf16, threads,
        )  # fmt: skip
    if failed:
        raise MemoryError("prefill attention could not allocate its buffers")
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: torch.Tensor,
    lengths: torch.Tensor,
    paged: bool = True,
) -> torch.Tensor:
    """One query token per request over its cached keys. Returns [B, N*D] in q's dtype.

    q [B, N, D]; k_cache, v_cache [K, S, D] (one layer of the pool); index [B, Lmax] int64 slots
    of each request's positions (entries past its length are ignored); lengths [B] int64 >= 1;
    paged: False takes the torch path on a GPU.
    """
    if q.device.type == "cuda":
        kernels = _paged() if paged else None
        if kernels is not None and q.dtype in _PAGED_DTYPES:
            return kernels.paged_decode_attention(q, k_cache, v_cache, index, lengths)
        return _decode_torch(q, k_cache, v_cache, index, lengths)
    lib = native.library() if q.device.type == "cpu" else None
    if lib is not None and q.dtype in _NATIVE_DTYPES and k_cache.is_contiguous():
        return _decode_native(lib, q, k_cache, v_cache, index, lengths)
    return _decode_torch(q, k_cache, v_cache, index, lengths)


@functools.cache
def _paged() -> ModuleType | None:
    """The Triton kernels of the GPU path, imported on first use (only a GPU imports triton);
    None where Triton is not installed, and the torch path gathers."""
    try:
        from toppings.server.model import paged
    except ImportError as e:
        log.warning("no Triton (%s): GPU attention gathers the paged KV (torch path)", e)
        return None
    return paged


def _decode_native(lib, q, k_cache, v_cache, index, lengths) -> torch.Tensor:
    b, n, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()  # rows may be strided (a view of the qkv projection), heads not
    index, lengths = index.contiguous(), lengths.contiguous()
    out = torch.empty(b, n, d, dtype=q.dtype)
    failed = getattr(lib, _NATIVE_DTYPES[q.dtype])(  # pointers as ints: argtypes c_void_p
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), index.data_ptr(),
        lengths.data_ptr(), b, n, k_cache.shape[0], d, index.shape[1], k_cache.shape[1],
        q.stride(0),
        d**-0.5, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("decode attention could not allocate its score buffers")
    return out.reshape(b, n * d)


def _decode_torch(q, k_cache, v_cache, index, lengths) -> torch.Tensor:
    """The same by a gather and batched matmuls over (kv head, request): the reference of the
    native and Triton paths, and the fallback where neither runs."""
    b, n, d = q.shape
    num_kv, lmax = k_cache.shape[0], index.shape[1]
    mask = torch.arange(lmax, device=q.device)[None, :] < lengths[:, None]  # [B, Lmax]
    flat = index.masked_fill(~mask, 0).reshape(-1)
    keys = k_cache.index_select(1, flat).view(num_kv, b, lmax, d)  # [K, B, L, D]
    vals = v_cache.index_select(1, flat).view(num_kv, b, lmax, d)
    qg = q.view(b, num_kv, -1, d).transpose(0, 1)  # [K, B, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * d**-0.5  # [K, B, G, L]
    scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, vals)  # [K, B, G, D]
    return out.transpose(0, 1).reshape(b, -1)
