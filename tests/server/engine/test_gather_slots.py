"""A prefill or mixed step's KV slots are read from the request table by one gather
(model_runner.gather_slots): the same slots, in the same order, as slicing each segment's row
and concatenating."""

from __future__ import annotations

import random

import torch

from toppings.server.engine.model_runner import gather_slots


def test_one_gather_gives_each_segment_s_slots_in_order():
    table = torch.arange(64 * 300, dtype=torch.int64).reshape(64, 300)  # [rows, Lmax]
    rng = random.Random(3)
    for _ in range(100):
        rows = rng.sample(range(64), rng.randint(1, 40))  # sliced up to 16, gathered past
        starts = [rng.randint(0, 200) for _ in rows]
        counts = [rng.choice([1, 1, rng.randint(1, 99)]) for _ in rows]  # decodes and chunks
        want = torch.cat([table[r, b : b + n] for r, b, n in zip(rows, starts, counts)])
        got = gather_slots(table, rows, starts, counts)
        assert got.dtype == table.dtype and torch.equal(got, want)
