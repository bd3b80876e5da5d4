"""The pool's small parts: row splitting, first-fit ranges, serial copies, arena headers."""

from __future__ import annotations

import struct

import pytest
import torch

from toppings.cpu_lora import protocol, repository
from toppings.cpu_lora.allocator import FirstFit
from toppings.cpu_lora.arena_header import align
from toppings.cpu_lora.profiling import choose_tokens_per_core
from toppings.cpu_lora.serial_copy import copy_serial, zeros_serial
from toppings.cpu_lora.split import num_parts, split_rows


def test_num_parts_follows_tokens_per_core():
    assert num_parts(0, 16, 8) == 0
    assert num_parts(1, 16, 8) == 1
    assert num_parts(33, 16, 8) == 3
    assert num_parts(1000, 16, 8) == 8


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_split_covers_every_row_once(parts):
    segments = [(0, 2, 10, 4), (1, 10, 13, 16), (2, 20, 31, 8)]  # gaps at 0-2, 13-20, 31-40
    slices = split_rows(segments, 40, parts)
    assert 1 <= len(slices) <= parts
    assert slices[0][0] == 0 and slices[-1][1] == 40
    assert all(prev[1] == cur[0] for prev, cur in zip(slices, slices[1:]))
    covered = sorted((s, a, b) for _, _, segs in slices for s, a, b in segs)
    for slot, start, end, _ in segments:  # each segment's tokens appear once, in order
        pieces = [(a, b) for s, a, b in covered if s == slot]
        assert pieces[0][0] == start and pieces[-1][1] == end
        assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
    works = [sum((b - a) * {0: 4, 1: 16, 2: 8}[s] for s, a, b in segs) for _, _, segs in slices]
    assert all(w > 0 for w in works)
    if parts > 1:
        assert max(works) <= sum(works) / len(works) + 16  # balanced to within one token


def test_tokens_per_core_balances_overhead_and_compute():
    counts = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    compute = [10.0 * n for n in counts]  # 10 us per token
    # rate n / (10 n + 100) is within 90% of its best (at 256) from n = 65 on
    assert choose_tokens_per_core(counts, compute, overhead_us=100.0) == 128
    assert choose_tokens_per_core(counts, compute, overhead_us=0.0) == 1
    assert choose_tokens_per_core(counts, compute, overhead_us=10.0) == 16


def test_first_fit_reuses_and_merges():
    space = FirstFit(100, 1000)
    a, b, c = space.allocate(300), space.allocate(300), space.allocate(300)
    assert (a, b, c) == (100, 400, 700) and space.allocate(200) is None
    space.release(b, 300)
    assert space.allocate(400) is None and space.allocate(200) == 400  # first fit, in b's range
    space.release(a, 300)
    space.release(400, 200)
    assert space.num_ranges == 2 and space.allocate(600) == 100  # a + b merged (plus 100 tail)
    space.release(100, 600)
    space.release(c, 300)
    assert space.num_ranges == 1 and space.free_bytes == 1000


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_serial_copy_equals_torch_copy(dst_dtype):
    src = torch.randn(300, 260)[:, 2:]  # strided rows, more than one grain
    dst = torch.empty(300, 258, dtype=dst_dtype)
    copy_serial(dst, src)
    assert torch.equal(dst, src.to(dst_dtype))
    flat = torch.randn(3 * 32768 + 5)  # 1-D, several grains
    flat_dst = torch.empty(flat.shape, dtype=dst_dtype)
    copy_serial(flat_dst, flat)
    assert torch.equal(flat_dst, flat.to(dst_dtype))
    zeros = zeros_serial(3, 5, dst_dtype)
    assert zeros.dtype == dst_dtype and not zeros.any()


@pytest.mark.parametrize("header", [protocol.HEADER, repository.HEADER])
def test_an_arena_header_reads_back_what_it_wrote_and_refuses_other_arenas(header):
    items = len(struct.unpack(header.fmt, bytes(struct.calcsize(header.fmt))))
    fields = tuple(range(3, items))  # one value per field after magic, version and dtype
    mapping = bytearray(repository.HEADER_BYTES)
    header.write(mapping, torch.bfloat16, *fields)
    assert bytes(mapping[:8]) == header.magic
    assert header.read(mapping, "/arena") == (torch.bfloat16, fields)
    other = protocol.HEADER if header is repository.HEADER else repository.HEADER
    with pytest.raises(ValueError, match=f"/arena is not a version-{other.version} {other.kind}"):
        other.read(mapping, "/arena")


def test_align_rounds_up_to_the_multiple():
    assert [align(n) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]
    assert align(4097, 4096) == 8192
