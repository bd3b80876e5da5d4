"""The compiled variants of the Triton LoRA kernels: what one launch compiles, and the finite set a
server can launch.

Triton compiles a kernel once per specialization: its constexprs (tile sizes, PADDED, UPCAST),
its pointers' dtypes, and its own specialization of the other arguments (an int equal to 1
becomes a constant; an int divisible by 16, and a pointer on a 16-byte boundary, are marked so
for wide loads). Each new one costs a compile of about a second on a GPU, and a compile inside
the first requests makes them wait for it (issue 63). So the set is explicit and finite:

- each kernel module's `plan` maps a launch's shapes to its `VariantKey`, and the launcher takes
  its constexprs from that key, so the key is what compiles;
- what changes from step to step stays out of the key: the rank bound and the split count are
  not specialized (`do_not_specialize`), the index pointers are not specialized on alignment (the
  kernels read them one scalar at a time), and the float32 workspace's rows are rounded to 16
  (`workspace_width`), so its strides are always divisible by 16;
- `LaunchSpace` is everything an engine's launches range over (the kernel, the dtype, the rank
  bound, the model's projection operands, the step's token budget), and each kernel module's
  `variants(space)` is every key reachable in it, with one launch that reaches it, which
  `warmup.warm_up` makes at start-up.

Pure Python: the server builds a `LaunchSpace` without importing triton.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

ALIGN_BYTES = 16  # Triton marks a pointer aligned, and an int divisible, at 16


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as `triton.next_power_of_2`."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pow2_buckets(top: int) -> list[int]:
    """One value of each power-of-two bucket of 1..top (what next_pow2 maps 1..top to): the
    powers of two below top, and top itself."""
    top = max(1, top)
    return [min(1 << i, top) for i in range(next_pow2(top).bit_length())]


def int_spec(value: int) -> str:
    """Triton's specialization of an int argument: "1" (compiled in as a constant), "D" (divisible
    by 16) or "" (neither)."""
    if value == 1:
        return "1"
    return "D" if value % ALIGN_BYTES == 0 else ""


def row_stride(t: torch.Tensor) -> int:
    """The row stride a launcher passes for t [rows, width]: a single row's stride is never read,
    and torch gives a one-row view whatever stride its source had, so it is passed as the width
    (one variant for it, not one per source)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def workspace_width(max_rank: int) -> int:
    """Columns of a launch's float32 partials [S, T, width]: max_rank rounded up to 16, so the
    workspace's strides are divisible by 16 whatever the rank bound and the token count."""
    return -(-max_rank // ALIGN_BYTES) * ALIGN_BYTES


class Operands(NamedTuple):
    """What Triton specializes of a launch's four matrices: x [T, H_in], y [T, H_out], lora_a
    [C, H_in], lora_b [C, H_out] (dtype, widths, row strides, whether each starts on 16 bytes)."""

    dtype: torch.dtype
    h_in: int
    h_out: int
    stride_x: int
    stride_y: int
    stride_a: int
    stride_b: int
    aligned: tuple[bool, bool, bool, bool]  # x, y, lora_a, lora_b

    @classmethod
    def of(cls, y, x, lora_a, lora_b) -> Operands:
        """The operands of one launch, from its tensors."""
        aligned = tuple(t.data_ptr() % ALIGN_BYTES == 0 for t in (x, y, lora_a, lora_b))
        return cls(
            x.dtype, x.shape[1], y.shape[1], row_stride(x), row_stride(y),
            row_stride(lora_a), row_stride(lora_b), aligned,
        )  # fmt: skip


class VariantKey(NamedTuple):
    """One compiled variant of a kernel module (its shrink and its expand kernel).

    kernel: "decode" or "prefill" (the module); padded: BGMV's tile of the rank bound, else
    MBGMV's chunks; dtype and index_dtypes: of x/y/pool and of offsets, ranks (and seg_starts);
    block_*: the tile constexprs (block_m 0 in decode); upcast: the interpreter's float32 dot;
    spec: Triton's specialization of every other argument it specializes, (name, "1"/"D"/"").
    """

    kernel: str
    padded: bool
    dtype: str
    index_dtypes: tuple[str, ...]
    block_m: int
    block_r: int
    block_k: int
    block_n: int
    upcast: bool
    spec: tuple[tuple[str, str], ...]


def spec_of(operands: Operands, k_per_split: int, width: int, num_tokens: int) -> tuple:
    """The `VariantKey.spec` of a launch: every argument Triton specializes beyond constexprs."""
    ints = {
        "H_in": operands.h_in, "H_out": operands.h_out, "k_per_split": k_per_split,
        "stride_x": operands.stride_x, "stride_y": operands.stride_y,
        "stride_a": operands.stride_a, "stride_b": operands.stride_b,
        "stride_hs": num_tokens * width, "stride_ht": width,
    }  # fmt: skip
    pointers = dict(zip(("x_ptr", "y_ptr", "a_ptr", "b_ptr"), operands.aligned, strict=True))
    return tuple((name, int_spec(v)) for name, v in ints.items()) + tuple(
        (name, "D" if ok else "") for name, ok in pointers.items()
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Launch:
    """A launch that reaches one variant: the kernel module's public function is called on
    tensors of these operands (`warmup.py` makes them), `num_tokens` tokens in `num_segments`
    equal segments (decode: one token each), index tensors of `index_dtype`, rank bound
    `max_rank`."""

    operands: Operands
    index_dtype: torch.dtype
    max_rank: int
    num_tokens: int
    num_segments: int


@dataclass(frozen=True)
class LaunchSpace:
    """Everything an engine's LoRA launches range over.

    padded: --kernel bgmv; max_rank: --max-lora-rank (the largest rank a step can hold);
    operands: every `Operands` the model hands the kernels (server/model/lora_operands.py);
    max_step_tokens: the most tokens one step computes; index_dtype: of offsets, ranks and
    seg_starts (int32: a step's LoraBatch, and the CUDA graphs' decode, make them so); device:
    where the launches run (the interpreter's bfloat16 dot is upcast on a CPU).
    """

    padded: bool
    max_rank: int
    operands: tuple[Operands, ...]
    max_step_tokens: int
    index_dtype: torch.dtype = torch.int32
    device: str = "cuda"

    def rank_bounds(self) -> list[int]:
        """One rank bound per power-of-two bucket up to next_pow2(max_rank): BGMV's tile is
        next_pow2 of a step's bound, and a step's bound is any rank from 1 to max_rank."""
        return pow2_buckets(self.max_rank)

    def tokens_per_segment(self) -> list[int]:
        """One count of tokens per segment in each power-of-two bucket up to the step budget
        (prefill's token tile follows next_pow2 of it; decode has one token a segment)."""
        return pow2_buckets(self.max_step_tokens)

    def launches(self, prefill: bool) -> Iterator[Launch]:
        """A covering set of launches of one kernel module (its `variants` keys each). Two
        segments each: a launch of one token passes its row strides as widths (`row_stride`)."""
        bounds = self.rank_bounds() if self.padded else [self.max_rank]
        per_segment = self.tokens_per_segment() if prefill else [1]
        for ops in self.operands:
            for bound in bounds:
                for n in per_segment:
                    yield Launch(ops, self.index_dtype, bound, 2 * n, 2)
