"""LoRA kernels for the engine on CPU: one matmul pair per adapter group, in float32.

Decode groups the batch's tokens by adapter, so each adapter's rows are read once and every
token is computed over its own rows only; nothing is assumed of the pool's other rows (they may
hold NaN). Prefill runs one matmul pair per segment, on the segment's contiguous tokens.

The engine uses these for prefill and for decode steps with a load in flight. A decode step
whose adapters are all resident uses `gpu_lora.dense_decode` instead: one masked product over
every adapter's rows, which relies on the pool keeping unowned rows at zero. Neither wins in
every dtype (ad-hoc, 1 thread, batch 64, 16 adapters r8-64, q/k/v of SmolLM2 x 30 layers:
bfloat16 dense 17 ms vs grouped 32 ms; float32 dense 56 ms vs grouped 26 ms), so both remain.

BGMV keeps its cost model on CPU: each group's weights are zero-padded to the batch's max_rank,
so its work grows with B x max_rank as on the GPU, and bgmv/mbgmv comparisons made on a CPU
engine measure the padding they are meant to measure. Semantics and arguments of every function
are those of the same-named function in `gpu_lora.kernels.reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toppings.gpu_lora.kernels.checks import check_decode, check_prefill, check_rows, check_segments

Tensor = torch.Tensor


def _weights(lora_a, lora_b, off: int, r: int, pad_to: int | None) -> tuple[Tensor, Tensor]:
    """An adapter's A [R, H_in] and B^T [R, H_out] in float32, zero-padded to pad_to rows."""
    a, b = lora_a[off : off + r].float(), lora_b[off : off + r].float()
    if pad_to is not None and pad_to > r:
        a = F.pad(a, (0, 0, 0, pad_to - r))
        b = F.pad(b, (0, 0, 0, pad_to - r))
    return a, b


def _add_rows(y: Tensor, rows: Tensor | None, delta: Tensor) -> None:
    """y[rows] += delta (rows None: all of y), summed in float32 and rounded once."""
    if rows is None:
        y.copy_(y.float() + delta) if y.dtype != torch.float32 else y.add_(delta)
    elif y.dtype == torch.float32:
        y.index_add_(0, rows, delta)
    else:
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))


def _decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank, padded: bool) -> None:
    offs, rks = offsets.tolist(), ranks.tolist()
    check_rows(offs, rks, lora_a.shape[0], max_rank)
    pad_to = max_rank if padded else None
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (off, r) in enumerate(zip(offs, rks, strict=True)):
        if r > 0:
            groups.setdefault((off, r), []).append(i)
    if not groups:
        return
    # Sort the tokens by adapter once, so that each group is a slice and costs three ops.
    order = [i for idx in groups.values() for i in idx]
    rows = None if order == list(range(y.shape[0])) else torch.tensor(order)
    xs = (x if rows is None else x.index_select(0, rows)).float()  # [n, H_in]
    ss = (scales if rows is None else scales.index_select(0, rows))[:, None]  # [n, 1]
    delta = torch.empty(len(order), y.shape[1], dtype=torch.float32)  # [n, H_out]
    start = 0
    for (off, r), idx in groups.items():
        sel = slice(start, start + len(idx))
        start += len(idx)
        a, b = _weights(lora_a, lora_b, off, r, pad_to)
        h = (xs[sel] @ a.T).mul_(ss[sel])  # [n_g, R]
        torch.mm(h, b, out=delta[sel])
    _add_rows(y, rows, delta)


def _prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank, padded) -> None:
    starts, offs, rks = seg_starts.tolist(), offsets.tolist(), ranks.tolist()
    check_segments(starts, y.shape[0])
    check_rows(offs, rks, lora_a.shape[0], max_rank)
    pad_to = max_rank if padded else None
    for seg, (off, r) in enumerate(zip(offs, rks, strict=True)):
        sel = slice(starts[seg], starts[seg + 1])
        if r == 0 or sel.stop == sel.start:
            continue
        a, b = _weights(lora_a, lora_b, off, r, pad_to)
        h = (x[sel].float() @ a.T).mul_(scales[seg])  # [n, R]
        if y.dtype == torch.float32:
            y[sel].addmm_(h, b)
        else:
            y[sel] = torch.addmm(y[sel].float(), h, b).to(y.dtype)


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
