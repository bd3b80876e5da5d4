"""A step's segments given as spans of the request table (PastTable, as the model runner gives
them) make the same attention plans as their pasts given one slice each (the per-segment
builders, which the kernels' exactness tests cover): the native CPU plan, with and without the
segments SDPA takes, and the Triton plan (host code, built on a CPU here); and a PastTable reads
as the list it stands for."""

from __future__ import annotations

import random

import numpy
import pytest
import torch

from toppings.server import native
from toppings.server.memory.past_table import PastTable
from toppings.server.model import attention, paged

MAX_LEN = 512


def random_step(seed: int) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """(table [R, MAX_LEN] of distinct slots, rows, starts, seg_starts) of a step mixing
    decode rows, short and long chunks, with and without a past, in random order."""
    rng = random.Random(seed)
    table = torch.randperm(40 * MAX_LEN, dtype=torch.int64).reshape(40, MAX_LEN)
    rows = rng.sample(range(40), rng.randint(1, 30))
    starts, counts = [], []
    for _ in rows:
        count = rng.choice([1, 1, 1, 3, 31, 32, 64, 200])
        starts.append(rng.choice([0, 0, 5, 100, 300]) if count > 1 else rng.randint(1, 400))
        counts.append(count)
    seg_starts = numpy.concatenate([[0], numpy.cumsum(counts)]).tolist()
    return table, rows, starts, seg_starts


def step_slots(table, rows, starts, seg_starts) -> torch.Tensor:
    counts = numpy.diff(seg_starts)
    return torch.cat([table[r, b : b + n] for r, b, n in zip(rows, starts, counts)])


def slices(table, rows, starts) -> list[torch.Tensor | None]:
    return [table[r, :b] if b else None for r, b in zip(rows, starts)]


def test_a_past_table_reads_as_its_slices():
    table, rows, starts, seg_starts = random_step(0)
    past = PastTable(table, rows, starts)
    want = slices(table, rows, starts)
    assert len(past) == len(want)
    for got, expected in zip(past, want):
        assert (got is None and expected is None) or torch.equal(got, expected)
    counts = numpy.diff(seg_starts)
    keep = numpy.arange(len(rows)) % 2 == 0
    spans = [table[r, : b + n] for r, b, n, k in zip(rows, starts, counts, keep) if k]
    assert torch.equal(past.spans(counts, keep), torch.cat(spans))


@pytest.mark.skipif(native.library() is None, reason="needs the native kernels (a compiler)")
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sdpa_from", [0, 32, 150])
def test_the_native_plan_is_the_same(seed, sdpa_from):
    table, rows, starts, seg_starts = random_step(seed)
    slots = step_slots(table, rows, starts, seg_starts)
    want = attention.plan_prefill(seg_starts, slices(table, rows, starts), slots, 1, True,
                                  sdpa_from)  # fmt: skip
    got = attention.plan_prefill(seg_starts, PastTable(table, rows, starts), slots, 1, True,
                                 sdpa_from)  # fmt: skip
    assert isinstance(got, attention.PrefillPlan) and isinstance(want, attention.PrefillPlan)
    for name in ("index", "row_start", "lengths", "tiles"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == torch.int64, name
    assert got.has_rows == want.has_rows and got.sdpa == want.sdpa


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("group", [1, 3, 8])
def test_the_triton_plan_is_the_same(seed, group):
    table, rows, starts, seg_starts = random_step(seed)
    slots = step_slots(table, rows, starts, seg_starts)
    want = paged.plan_paged(seg_starts, slices(table, rows, starts), slots, group)
    got = paged.plan_paged(seg_starts, PastTable(table, rows, starts), slots, group)
    assert got.tile_tokens == want.tile_tokens
    assert torch.equal(got.index, want.index) and torch.equal(got.tiles, want.tiles)
