"""LoRA kernels for the engine on CPU: one matmul pair per run of one adapter's tokens.

The engine orders a step's requests by adapter, so each adapter's tokens are one contiguous run
(`lora_batch`): prefill and decode both call the segment kernels over those runs, so each
adapter's rows are read once per projection and every token is computed over its own adapter's
rows only (nothing is assumed of the pool's other rows; they may hold NaN). The decode kernels,
for tokens in any order, sort them into such runs first. Arithmetic is in float32 and y is
rounded once: torch's bfloat16 matmuls of these small shapes took several times longer than
converting to float32 and multiplying there (docs/benchmarks.md, "Measurements behind the code").

BGMV keeps its cost model on CPU: each run's weights are zero-padded to the batch's max_rank, so
its work grows with B x max_rank as on the GPU, and bgmv/mbgmv comparisons made on a CPU engine
measure the padding they are meant to measure. Semantics and arguments of every function are
those of the same-named function in `gpu_lora.kernels.reference`.

`lora_rows` is the host's x @ A.T @ B^T of one adapter's run of tokens, written rather than
added: the in-process host path (`gpu_lora.host_lora`) and the CPU workers (`cpu_lora.compute`)
both call it, so the host deltas are the same numbers with or without workers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toppings.gpu_lora.kernels.checks import check_decode, check_prefill, check_rows, check_segments

Tensor = torch.Tensor


def _segments(y, x, lora_a, lora_b, runs, pad_to: int | None) -> None:
    """y[s:e] += scale * (x[s:e] @ A.T) @ B for each run (s, e, offset, rank, scale), in place."""
    for start, end, off, r, scale in runs:
        if r == 0 or end == start:
            continue
        a, b = lora_a[off : off + r], lora_b[off : off + r]  # A [R, H_in], B^T [R, H_out]
        if pad_to is not None and pad_to > r:
            a = F.pad(a, (0, 0, 0, pad_to - r))
            b = F.pad(b, (0, 0, 0, pad_to - r))
        if y.dtype == torch.float32:
            h = x[start:end] @ a.T  # [n, R]
            y[start:end].addmm_(h, b, alpha=scale)
        else:
            a, b = a.float(), b.float()
            h = x[start:end].float() @ a.T
            y[start:end] = torch.addmm(y[start:end].float(), h, b, alpha=scale).to(y.dtype)


def _decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank, padded: bool) -> None:
    offs, rks, scs = offsets.tolist(), ranks.tolist(), scales.tolist()
    check_rows(offs, rks, lora_a.shape[0], max_rank)
    groups: dict[tuple[int, int, float], list[int]] = {}
    for i, key in enumerate(zip(offs, rks, scs, strict=True)):
        if key[1] > 0:
            groups.setdefault(key, []).append(i)
    if not groups:
        return
    order = [i for idx in groups.values() for i in idx]
    runs, start = [], 0
    for (off, r, scale), idx in groups.items():
        runs.append((start, start + len(idx), off, r, scale))
        start += len(idx)
    pad_to = max_rank if padded else None
    if order == list(range(y.shape[0])):  # already in runs: add in place
        _segments(y, x, lora_a, lora_b, runs, pad_to)
        return
    rows = torch.tensor(order)
    ys = y.index_select(0, rows)  # [n, H_out]
    _segments(ys, x.index_select(0, rows), lora_a, lora_b, runs, pad_to)
    y.index_copy_(0, rows, ys)


def _prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank, padded) -> None:
    starts, offs, rks = seg_starts.tolist(), offsets.tolist(), ranks.tolist()
    check_segments(starts, y.shape[0])
    check_rows(offs, rks, lora_a.shape[0], max_rank)
    runs = zip(starts[:-1], starts[1:], offs, rks, scales.tolist(), strict=True)
    _segments(y, x, lora_a, lora_b, runs, max_rank if padded else None)


def bgmv_decode(
    y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor,
    offsets: Tensor, ranks: Tensor, scales: Tensor, max_rank: int,
) -> None:  # fmt: skip
    """BGMV decode on CPU: y[i] += scales[i] * (x[i] @ A_i.T) @ B_i per token, in place.

    Semantics (full: `gpu_lora.kernels.reference.bgmv_decode`):
        A_i, B_i = lora_a[offsets[i]:offsets[i] + ranks[i]], lora_b[same rows]; ranks[i] == 0: skip
        every token is computed over max_rank rows, rows past ranks[i] zero-padded

    Args: y [B, H_out] (in place), x [B, H_in], lora_a [C, H_in], lora_b [C, H_out], all one of
    float32/bfloat16/float16; offsets, ranks [B] int32/int64; scales [B] float32;
    max_rank int >= max(ranks).
    """
    check_decode(y, x, lora_a, lora_b, offsets, ranks, scales)
    _decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank, padded=True)


def mbgmv_decode(
    y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor,
    offsets: Tensor, ranks: Tensor, scales: Tensor, max_rank: int | None = None,
) -> None:  # fmt: skip
    """MBGMV decode on CPU: y[i] += scales[i] * (x[i] @ A_i.T) @ B_i per token, in place.

    Semantics (full: `gpu_lora.kernels.reference.mbgmv_decode`):
        A_i, B_i = lora_a[offsets[i]:offsets[i] + ranks[i]], lora_b[same rows]; ranks[i] == 0: skip
        every token is computed over exactly its own ranks[i] rows (zero-padded weights)

    Args: y [B, H_out] (in place), x [B, H_in], lora_a [C, H_in], lora_b [C, H_out], all one of
    float32/bfloat16/float16; offsets, ranks [B] int32/int64; scales [B] float32;
    max_rank optional int >= max(ranks), checked.
    """
    check_decode(y, x, lora_a, lora_b, offsets, ranks, scales)
    _decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank, padded=False)


def bgmv_prefill(
    y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, seg_starts: Tensor,
    offsets: Tensor, ranks: Tensor, scales: Tensor, max_rank: int,
) -> None:  # fmt: skip
    """BGMV prefill on CPU: y[t] += scales[b] * (x[t] @ A_b.T) @ B_b per segment b, in place.

    Semantics (full: `gpu_lora.kernels.reference.bgmv_prefill`):
        for t in seg_starts[b]:seg_starts[b + 1]: A_b, B_b = rows offsets[b]:offsets[b] + ranks[b]
        every token is computed over max_rank rows, rows past ranks[b] zero-padded

    Args: y [T, H_out] (in place), x [T, H_in], lora_a [C, H_in], lora_b [C, H_out], all one of
    float32/bfloat16/float16; seg_starts [B + 1], offsets, ranks [B] int32/int64; scales [B]
    float32; max_rank int >= max(ranks).
    """
    check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    _prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank, padded=True)


def mbgmv_prefill(
    y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, seg_starts: Tensor,
    offsets: Tensor, ranks: Tensor, scales: Tensor, max_rank: int | None = None,
) -> None:  # fmt: skip
    """MBGMV prefill on CPU: y[t] += scales[b] * (x[t] @ A_b.T) @ B_b per segment b, in place.

    Semantics (full: `gpu_lora.kernels.reference.mbgmv_prefill`):
        for t in seg_starts[b]:seg_starts[b + 1]: A_b, B_b = rows offsets[b]:offsets[b] + ranks[b]
        every token is computed over exactly its own ranks[b] rows (zero-padded weights)

    Args: y [T, H_out] (in place), x [T, H_in], lora_a [C, H_in], lora_b [C, H_out], all one of
    float32/bfloat16/float16; seg_starts [B + 1], offsets, ranks [B] int32/int64; scales [B]
    float32; max_rank optional int >= max(ranks), checked.
    """
    check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    _prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank, padded=False)


def lora_rows(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> None:
    """Write one adapter's LoRA delta of a run of tokens into out, in out's dtype.

    Semantics (full: `gpu_lora.kernels.reference.lora_rows`):
        out[:] = (scale * (x @ lora_a.T)) @ lora_b    # scale applied to the [n, R] product

    Args: out [n, H_out] (written in place), x [n, H_in], lora_a [R, H_in] (A), lora_b [R, H_out]
    (B^T, may be a transposed view), all one of float32/bfloat16/float16; scale float. Arithmetic
    in that dtype (bfloat16 matmuls use the CPU's bf16 units where it has them).
    """
    h = torch.mm(x, lora_a.T)  # [n, R]
    h.mul_(scale)
    torch.mm(h, lora_b, out=out)
