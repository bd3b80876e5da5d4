"""Decode attention over the token-level KV pool in Triton, one query per request, reading each
key and value row by its slot inside the kernel (the GPU's path of `attention.decode_attention`).

The torch path gathers every request's keys and values into a dense [K, B, Lmax, D] copy first:
on an H200 profile of a decode run that gather was the largest kernel (36% of device time).
Here a program loads its rows straight from the pool by the slots in `index`, flash-decoding
style (online softmax, float32 accumulation):

Stage 1, grid (B, K, S): program (b, kh, s) attends the G = N / K query heads of kv head kh of
request b (one tl.dot tile of BLOCK_G >= 16 rows, padded heads zero) to positions
[s * chunk, min((s + 1) * chunk, lengths[b])) in blocks of BLOCK_N slots. With S == 1 it writes
the output itself; else its normalized partial output and log-sum-exp go to a float32 workspace.
Stage 2, grid (B, N): merges the S partials of each query head, weighting each by its share of
the softmax mass; splits past a request's length (empty) are never read.

S splits the padded width Lmax when B * K programs alone would leave the GPU idle (one request
of a long context): a rule of the shapes only, so a CUDA graph captures it (no host sync, no
value read from the device). Entries of `index` past a request's length are never loaded.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # slots per step of a program's loop
TARGET_PROGRAMS = 256  # stage-1 programs worth launching: a few per SM of an H100/H200
MAX_SPLITS = 16
MIN_CHUNK = 128  # positions per split at least: a partial written per 2 x 128 rows read
LOG2E = 1.4426950408889634


@triton.jit
def attend_block(
    q, acc, m, l_sum, k_base, v_base, slots, d, d_ok, col_ok, keep,
    stride_ks, stride_vs, qk_scale, UPCAST: tl.constexpr,
):  # fmt: skip
    """One block of key positions into the online softmax of the R query rows of q (the split
    kernel's heads of one kv head, the prefill kernel's tokens x heads of a tile).

    Semantics: s = qk_scale * q @ k[slots].T (log2 units), -inf where not `keep`; m' = max(m,
    rowmax s); l' = l * 2^(m - m') + rowsum 2^(s - m'); acc' = acc * 2^(m - m') +
    2^(s - m') @ v[slots], the probabilities in the cache's dtype as the torch path has them.
    q [R, BLOCK_D]; acc [R, BLOCK_D], m, l_sum [R] float32; k_base, v_base: one kv head of the
    pool; slots [BLOCK_N] int64; col_ok [BLOCK_N]: positions that exist (the others are not
    loaded); keep [R, BLOCK_N]: what each row attends. Returns (acc', m', l')."""
    kt = tl.load(  # [BLOCK_D, BLOCK_N]
        k_base + slots[None, :] * stride_ks + d[:, None],
        mask=d_ok[:, None] & col_ok[None, :], other=0.0,
    )  # fmt: skip
    if UPCAST:
        kt = kt.to(tl.float32)
    # ieee: float32 tiles without TF32 rounding (16-bit ones multiply exactly either way)
    scores = tl.dot(q, kt, input_precision="ieee") * qk_scale  # [R, BLOCK_N], log2
    scores = tl.where(keep, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    vals = tl.load(  # [BLOCK_N, BLOCK_D]
        v_base + slots[:, None] * stride_vs + d[None, :],
        mask=col_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    p = p.to(v_base.dtype.element_ty)  # as the torch path: probabilities in the cache's dtype
    if UPCAST:
        p, vals = p.to(tl.float32), vals.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, vals, input_precision="ieee")
    return acc, m_new, l_sum


@triton.jit
def _split_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, q_ptr, k_ptr, v_ptr, index_ptr, lengths_ptr,
    qk_scale, chunk, G, D,
    stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_ib,
    stride_ob, stride_pb, stride_ph, stride_ps,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FINAL: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    if lo >= hi:  # past this request's length: stage 2 never reads this split
        return
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < G, d < D
    heads = kh * G + g  # [BLOCK_G] query heads of this kv head
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + kh.to(tl.int64) * stride_kh
    v_base = v_ptr + kh.to(tl.int64) * stride_vh
    index_row = index_ptr + b.to(tl.int64) * stride_ib
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        slots = tl.load(index_row + pos, mask=pos_ok, other=0).to(tl.int64)  # [BLOCK_N]
        acc, m, l_sum = attend_block(  # [BLOCK_G, BLOCK_D], [BLOCK_G], [BLOCK_G]
            q, acc, m, l_sum, k_base, v_base, slots, d, d_ok, pos_ok, pos_ok[None, :],
            stride_ks, stride_vs, qk_scale, UPCAST,
        )  # fmt: skip
    acc = acc / l_sum[:, None]
    mask = g_ok[:, None] & d_ok[None, :]
    if FINAL:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * D + d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps  # [BLOCK_G]
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], acc, mask=mask)
        tl.store(part_lse_ptr + part, m + tl.log2(l_sum), mask=g_ok)


@triton.jit
def _merge_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, lengths_ptr, chunk, D,
    stride_ob, stride_pb, stride_ph, stride_ps,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s * chunk < length  # splits holding at least one position
    part = b.to(tl.int64) * stride_pb + head * stride_ph + s * stride_ps  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    o_mask = s_ok[:, None] & (d < D)[None, :]
    o = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=o_mask, other=0.0)  # [S, D]
    w = tl.exp2(lse - tl.max(lse, axis=0))  # [BLOCK_S]; split 0 always holds position 0
    merged = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)  # [BLOCK_D]
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head * D + d
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=d < D)


def check_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The group G = N / K of q [*, N, D] over k_cache, v_cache [K, S, D], once their shapes,
    strides and device are checked."""
    n, d = q.shape[1:]
    num_kv = k_cache.shape[0]
    if n % num_kv or k_cache.shape[2] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit k/v {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("paged attention needs stride 1 along the head dim")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 before import")
    return n // num_kv


def upcast(q: torch.Tensor) -> bool:
    """Whether tiles go to tl.dot as float32: Triton's interpreter multiplies 16-bit tiles as raw
    integers there (16-bit products are exact in float32, so the compiled kernel's sums agree)."""
    return q.device.type == "cpu" and q.dtype != torch.float32


def num_splits(batch: int, num_kv: int, max_len: int) -> int:
    """Splits of the padded width: enough programs for the GPU, each at least MIN_CHUNK long."""
    wanted = triton.cdiv(TARGET_PROGRAMS, batch * num_kv)
    return max(1, min(MAX_SPLITS, wanted, max_len // MIN_CHUNK))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: torch.Tensor,
    lengths: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:
    """One query token per request over its keys and values read in place from the pool.

    Semantics (reference: `attention._decode_torch`):
        for b, head h (kv head kh = h // G, G = N // K):
            slots = index[b, :lengths[b]]
            p = softmax(q[b, h] . k_cache[kh, slots].T / sqrt(D))   (float32)
            out[b, h] = p.to(dtype) @ v_cache[kh, slots]             (float32 accumulation)

    Args: q [B, N, D] (rows may be strided, stride 1 along D); k_cache, v_cache [K, S, D] (one
    layer of the pool, stride 1 along D), all float32, bfloat16 or float16; index [B, Lmax]
    int64 or int32 slots, entries past lengths[b] never read; lengths [B] int >= 1, <= Lmax;
    splits: stage-1 splits of Lmax (None: `num_splits`). Returns [B, N*D] in q's dtype.
    CPU tensors need TRITON_INTERPRET=1 set before triton was imported.
    """
    b, n, d = q.shape
    num_kv, lmax = k_cache.shape[0], index.shape[1]
    group = check_launch(q, k_cache, v_cache)
    out = torch.empty(b, n * d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    index, lengths = index.contiguous(), lengths.contiguous()
    s = splits if splits is not None else num_splits(b, num_kv, lmax)
    chunk = triton.cdiv(triton.cdiv(lmax, s), BLOCK_N) * BLOCK_N
    s = triton.cdiv(lmax, chunk)  # no split left empty by the rounding
    block_g, block_d = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(d))
    part_o = part_lse = out  # unused unless split
    if s > 1:
        part_o = torch.empty(b, n, s, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, n, s, dtype=torch.float32, device=q.device)
    _split_kernel[(b, num_kv, s)](
        out, part_o, part_lse, q, k_cache, v_cache, index, lengths,
        d**-0.5 * LOG2E, chunk, group, d,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), index.stride(0),
        out.stride(0), n * s, s, 1,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=BLOCK_N, FINAL=s == 1, UPCAST=upcast(q),
    )  # fmt: skip
    if s > 1:
        _merge_kernel[(b, n)](
            out, part_o, part_lse, lengths, chunk, d,
            out.stride(0), n * s, s, 1,
            BLOCK_S=triton.next_power_of_2(s), BLOCK_D=block_d,
        )  # fmt: skip
    return out
