"""Compile every variant of the Triton LoRA kernels before a request needs one.

`warm_up(space, device)` launches each key of `triton_decode.variants(space)` and
`triton_prefill.variants(space)` once, through the kernels' public functions (the same launch
code a step runs), on small tensors of zeros shaped to reach it: the pool holds one adapter of
the launch's rank bound at row 0, two segments of equal length. Before each launch it checks
that the tensors it made plan to the key it enumerated, so a warm-up never compiles something
else than what it claims. Each compile is written to Triton's on-disk cache (TRITON_CACHE_DIR,
~/.triton/cache by default), so a start-up whose cache survived from the last one loads the
binaries instead of compiling them (docs/deploy.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from toppings.gpu_lora.kernels.variants import ALIGN_BYTES, Launch, LaunchSpace, Operands


@dataclass(frozen=True)
class WarmupResult:
    """What a warm-up launched: variants per kernel module, and the wall time it took."""

    decode_variants: int
    prefill_variants: int
    seconds: float

    @property
    def num_variants(self) -> int:
        return self.decode_variants + self.prefill_variants


def _matrix(rows: int, width: int, stride: int, aligned: bool, dtype, device) -> torch.Tensor:
    """Zeros [rows, width] with row stride `stride`, starting on 16 bytes or one element past."""
    lead = 0 if aligned else 1
    size = lead + (rows - 1) * stride + width + ALIGN_BYTES
    store = torch.zeros(size, dtype=dtype, device=device)
    return store.as_strided((rows, width), (stride, 1), lead)


def launch_tensors(launch: Launch, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales) that reach `launch`."""
    ops: Operands = launch.operands
    t, r, idx = launch.num_tokens, launch.max_rank, launch.index_dtype
    x_ok, y_ok, a_ok, b_ok = ops.aligned
    x = _matrix(t, ops.h_in, ops.stride_x, x_ok, ops.dtype, device)
    y = _matrix(t, ops.h_out, ops.stride_y, y_ok, ops.dtype, device)
    a = _matrix(max(r, 2), ops.h_in, ops.stride_a, a_ok, ops.dtype, device)
    b = _matrix(max(r, 2), ops.h_out, ops.stride_b, b_ok, ops.dtype, device)
    segs = launch.num_segments
    seg_starts = torch.arange(0, t + 1, t // segs, dtype=idx, device=device)  # [S + 1]
    offsets = torch.zeros(segs, dtype=idx, device=device)
    ranks = torch.full((segs,), r, dtype=idx, device=device)
    scales = torch.ones(segs, dtype=torch.float32, device=device)
    return y, x, a, b, seg_starts, offsets, ranks, scales


def warm_up(space: LaunchSpace, device: torch.device | str) -> WarmupResult:
    """Launch every decode and prefill variant of `space` once on `device` (Triton: a GPU, or a
    CPU under TRITON_INTERPRET=1); waits for the device before it returns."""
    from toppings.gpu_lora.kernels import triton_decode, triton_prefill  # imports triton

    begin = time.perf_counter()
    kind = "bgmv" if space.padded else "mbgmv"
    decode = getattr(triton_decode, f"{kind}_decode")
    prefill = getattr(triton_prefill, f"{kind}_prefill")
    decode_variants = triton_decode.variants(space)
    for key, launch in decode_variants.items():
        y, x, a, b, _, offsets, ranks, scales = launch_tensors(launch, device)
        made = triton_decode.plan(Operands.of(y, x, a, b), (offsets.dtype, ranks.dtype),
                                  launch.max_rank, space.padded, launch.num_tokens).key  # fmt: skip
        _check(key, made)
        decode(y, x, a, b, offsets, ranks, scales, launch.max_rank)
    prefill_variants = triton_prefill.variants(space)
    for key, launch in prefill_variants.items():
        y, x, a, b, seg_starts, offsets, ranks, scales = launch_tensors(launch, device)
        made = triton_prefill.plan(
            Operands.of(y, x, a, b), (seg_starts.dtype, offsets.dtype, ranks.dtype),
            launch.max_rank, space.padded, launch.num_tokens, launch.num_segments, key.upcast,
        ).key  # fmt: skip
        _check(key, made)
        prefill(y, x, a, b, seg_starts, offsets, ranks, scales, launch.max_rank)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - begin
    return WarmupResult(len(decode_variants), len(prefill_variants), seconds)


def _check(key, made) -> None:
    if made != key:
        raise RuntimeError(f"warm-up tensors plan to {made}, not to the variant {key}")
