"""Argument checks shared by every kernel backend.

Shape, dtype and device checks are cheap and run everywhere. Checks that read the index tensors'
values (`check_rows`) need them on the host, so only the reference and CPU backends run them; the
Triton launchers never synchronize with the device to validate.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_shapes(y, x, lora_a, lora_b) -> None:
    """y, x, lora_a, lora_b are 2-D, agree on tokens and widths, and share one float dtype."""
    if y.dim() != 2 or x.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2:
        raise ValueError("y, x, lora_a and lora_b must be 2-D")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} disagree on the token count")
    if lora_a.shape[1] != x.shape[1]:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} does not match x {tuple(x.shape)}")
    if lora_b.shape[1] != y.shape[1]:
        raise ValueError(f"lora_b {tuple(lora_b.shape)} does not match y {tuple(y.shape)}")
    if lora_a.shape[0] != lora_b.shape[0]:
        raise ValueError("lora_a and lora_b must have the same number of pool rows")
    if y.dtype not in FLOAT_DTYPES or not (y.dtype == x.dtype == lora_a.dtype == lora_b.dtype):
        raise TypeError(
            f"y, x, lora_a, lora_b must share one of {FLOAT_DTYPES}, got "
            f"{y.dtype}, {x.dtype}, {lora_a.dtype}, {lora_b.dtype}"
        )


def _check_meta(y, offsets, ranks, scales, num: int) -> None:
    for name, t in (("offsets", offsets), ("ranks", ranks)):
        if t.dtype not in INDEX_DTYPES or t.shape != (num,):
            raise TypeError(
                f"{name} must be int32/int64 of shape ({num},), got {t.dtype} {t.shape}"
            )
    if scales.dtype != torch.float32 or scales.shape != (num,):
        raise TypeError(f"scales must be float32 of shape ({num},), got {scales.dtype}")
    devices = {t.device for t in (offsets, ranks, scales)}
    if devices != {y.device}:
        raise ValueError(f"all tensors must be on {y.device}, got {devices}")


def check_decode(y, x, lora_a, lora_b, offsets, ranks, scales) -> None:
    """Validate the arguments of a decode kernel (one token per request)."""
    check_shapes(y, x, lora_a, lora_b)
    _check_meta(y, offsets, ranks, scales, y.shape[0])
    if {x.device, lora_a.device, lora_b.device} != {y.device}:
        raise ValueError("y, x, lora_a and lora_b must be on one device")


def check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales) -> None:
    """Validate the arguments of a prefill kernel (one segment of tokens per request)."""
    check_shapes(y, x, lora_a, lora_b)
    num_segments = seg_starts.shape[0] - 1 if seg_starts.dim() == 1 else -1
    if seg_starts.dtype not in INDEX_DTYPES or num_segments < 0:
        raise TypeError("seg_starts must be a 1-D int32/int64 tensor of B+1 entries")
    _check_meta(y, offsets, ranks, scales, num_segments)
    if {x.device, lora_a.device, lora_b.device, seg_starts.device} != {y.device}:
        raise ValueError("all tensors must be on one device")


def check_rows(offsets: list[int], ranks: list[int], num_rows: int, max_rank: int | None) -> None:
    """Every adapter lies inside the pool and no rank exceeds max_rank (host values)."""
    for off, r in zip(offsets, ranks, strict=True):
        if r < 0 or (max_rank is not None and r > max_rank):
            raise ValueError(f"rank {r} outside [0, max_rank={max_rank}]")
        if r > 0 and (off < 0 or off + r > num_rows):
            raise ValueError(f"adapter rows [{off}, {off + r}) outside the pool of {num_rows}")


def check_segments(seg_starts: list[int], num_tokens: int) -> None:
    """Segments are ordered and inside [0, T) (host values)."""
    if any(b < a for a, b in zip(seg_starts, seg_starts[1:], strict=False)):
        raise ValueError(f"seg_starts must be non-decreasing, got {seg_starts}")
    if seg_starts and (seg_starts[0] < 0 or seg_starts[-1] > num_tokens):
        raise ValueError(f"segments {seg_starts[0]}..{seg_starts[-1]} outside [0, {num_tokens}]")
