"""Float32 torch reference of the four LoRA kernels: the oracle every backend is tested against.

Column pool (one layer, one projection): `lora_a` [C, H_in] and `lora_b` [C, H_out]. An adapter
of rank r at offset off owns rows [off, off + r): there `lora_a` holds PEFT's `lora_A.weight`
[r, H_in] and `lora_b` holds PEFT's `lora_B.weight` transposed, [r, H_out]. Rows no adapter of
the call owns may hold anything (NaN included) and never reach y. A request of rank 0 has no
adapter: its rows of y are left untouched.

BGMV (Punica) and MBGMV (S-LoRA) compute the same numbers; they differ in cost (BGMV pads every
token to the batch's max_rank, MBGMV works on each token's own rank), which is the backends'
business, so the reference implements both with one loop. The optional `max_rank` of the MBGMV
functions is only a bound on `ranks` that lets the Triton launchers size their workspace without
a device sync; results never depend on it.
"""

from __future__ import annotations

import torch

from toppings.gpu_lora.kernels.checks import check_decode, check_prefill, check_rows, check_segments


def _add_delta(y_rows: torch.Tensor, x_rows: torch.Tensor, a, b, scale: float) -> None:
    """y_rows += scale * (x_rows @ a.T) @ b in float32, rounded once into y's dtype."""
    h = x_rows.float() @ a.float().T  # [n, r]
    delta = scale * (h @ b.float())  # [n, H_out]
    y_rows.copy_((y_rows.float() + delta).to(y_rows.dtype))


def bgmv_decode(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    max_rank: int,
) -> None:
    """Add each decode token's LoRA delta into y, every token padded to max_rank rows (BGMV).

    Semantics:
        for i in range(B):
            off, r = offsets[i], ranks[i]
            if r > 0:
                h = lora_a[off:off + r] @ x[i]                 # [r]
                y[i] += scales[i] * (h @ lora_b[off:off + r])  # [H_out]
        # rows off+r .. off+max_rank-1 are padding and contribute exactly zero

    Args:
        y: [B, H_out] float32/bfloat16/float16, updated in place.
        x: [B, H_in], same dtype as y: one token per request.
        lora_a: [C, H_in], same dtype: column pool of A (rows of PEFT's lora_A.weight).
        lora_b: [C, H_out], same dtype: column pool of B^T (rows of PEFT's lora_B.weight.T).
        offsets: [B] int32/int64, first pool row of each request's adapter.
        ranks: [B] int32/int64, each request's rank; 0 means no adapter.
        scales: [B] float32, each request's lora_alpha / r.
        max_rank: int >= max(ranks), the padded rank every token is computed at.
    """
    check_decode(y, x, lora_a, lora_b, offsets, ranks, scales)
    _decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank)


def mbgmv_decode(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    max_rank: int | None = None,
) -> None:
    """Add each decode token's LoRA delta into y over exactly its own rank rows (MBGMV).

    Semantics:
        for i in range(B):
            off, r = offsets[i], ranks[i]
            if r > 0:
                y[i] += scales[i] * ((lora_a[off:off + r] @ x[i]) @ lora_b[off:off + r])

    Args:
        y: [B, H_out] float32/bfloat16/float16, updated in place.
        x: [B, H_in], same dtype as y: one token per request.
        lora_a: [C, H_in], same dtype: column pool of A.
        lora_b: [C, H_out], same dtype: column pool of B^T.
        offsets: [B] int32/int64, first pool row of each request's adapter.
        ranks: [B] int32/int64, each request's rank; 0 means no adapter.
        scales: [B] float32, each request's lora_alpha / r.
        max_rank: optional int >= max(ranks); a workspace bound, not padding.
    """
    check_decode(y, x, lora_a, lora_b, offsets, ranks, scales)
    _decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank)


def _decode(y, x, lora_a, lora_b, offsets, ranks, scales, max_rank) -> None:
    offs, rks = offsets.tolist(), ranks.tolist()
    check_rows(offs, rks, lora_a.shape[0], max_rank)
    for i, (off, r) in enumerate(zip(offs, rks, strict=True)):
        if r > 0:
            a, b = lora_a[off : off + r], lora_b[off : off + r]
            _add_delta(y[i : i + 1], x[i : i + 1], a, b, float(scales[i]))


def bgmv_prefill(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    max_rank: int,
) -> None:
    """Add each prefill segment's LoRA delta into y, every token padded to max_rank rows (BGMV).

    Semantics:
        for b in range(B):
            off, r = offsets[b], ranks[b]
            for i in range(seg_starts[b], seg_starts[b + 1]):
                if r > 0:
                    y[i] += scales[b] * ((lora_a[off:off + r] @ x[i]) @ lora_b[off:off + r])
        # padding rows off+r .. off+max_rank-1 contribute exactly zero

    Args:
        y: [T, H_out] float32/bfloat16/float16, updated in place.
        x: [T, H_in], same dtype as y.
        lora_a: [C, H_in], same dtype: column pool of A.
        lora_b: [C, H_out], same dtype: column pool of B^T.
        seg_starts: [B + 1] int32/int64, non-decreasing; segment b (one request) is the tokens
            seg_starts[b]:seg_starts[b + 1]. Tokens outside every segment are untouched.
        offsets: [B] int32/int64, first pool row of each segment's adapter.
        ranks: [B] int32/int64, each segment's rank; 0 means no adapter.
        scales: [B] float32, each segment's lora_alpha / r.
        max_rank: int >= max(ranks), the padded rank every token is computed at.
    """
    check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    _prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank)


def mbgmv_prefill(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    max_rank: int | None = None,
) -> None:
    """Add each prefill segment's LoRA delta into y over exactly its own rank rows (MBGMV).

    Semantics:
        for b in range(B):
            off, r = offsets[b], ranks[b]
            for i in range(seg_starts[b], seg_starts[b + 1]):
                if r > 0:
                    y[i] += scales[b] * ((lora_a[off:off + r] @ x[i]) @ lora_b[off:off + r])

    Args:
        y: [T, H_out] float32/bfloat16/float16, updated in place.
        x: [T, H_in], same dtype as y.
        lora_a: [C, H_in], same dtype: column pool of A.
        lora_b: [C, H_out], same dtype: column pool of B^T.
        seg_starts: [B + 1] int32/int64, non-decreasing segment bounds (see bgmv_prefill).
        offsets: [B] int32/int64, first pool row of each segment's adapter.
        ranks: [B] int32/int64, each segment's rank; 0 means no adapter.
        scales: [B] float32, each segment's lora_alpha / r.
        max_rank: optional int >= max(ranks); a workspace bound, not padding.
    """
    check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    _prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank)


def _prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales, max_rank) -> None:
    starts, offs, rks = seg_starts.tolist(), offsets.tolist(), ranks.tolist()
    check_segments(starts, y.shape[0])
    check_rows(offs, rks, lora_a.shape[0], max_rank)
    for b, (off, r) in enumerate(zip(offs, rks, strict=True)):
        for i in range(starts[b], starts[b + 1]):
            if r > 0:
                a, bt = lora_a[off : off + r], lora_b[off : off + r]
                _add_delta(y[i : i + 1], x[i : i + 1], a, bt, float(scales[b]))


def lora_rows(
    out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> None:
    """Write one adapter's LoRA delta of a run of tokens into out (the host path's kernel).

    Semantics:
        out[:] = scale * (x @ lora_a.T) @ lora_b      # written, not added

    Args:
        out: [n, H_out] float32/bfloat16/float16, written in place.
        x: [n, H_in], same dtype as out: the run's tokens.
        lora_a: [R, H_in], same dtype: the adapter's A (PEFT's lora_A.weight).
        lora_b: [R, H_out], same dtype: the adapter's B^T (PEFT's lora_B.weight.T).
        scale: the adapter's lora_alpha / r.
    """
    h = x.float() @ lora_a.float().T  # [n, R]
    out.copy_((scale * (h @ lora_b.float())).to(out.dtype))
