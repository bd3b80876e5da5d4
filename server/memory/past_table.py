"""A prefill or mixed step's segments as spans of the pool's request table, for the attention
plans to build with a few array operations instead of a tensor slice and a `torch.cat` per
segment.

Segment i of a step is request row `rows[i]` of the table (the pool's `req_to_slot` [R, Lmax]),
whose past is its first `starts[i]` slots and whose t_i new tokens went to the next t_i (the
scheduler reserved them before the step; server.memory.kv_cache). So the slot list attention
reads for it, its past then its own tokens, is `table[rows[i], : starts[i] + t_i]`, and a
step's lists one after another are one gather. A mixed step beside 256 decodes has 257
segments: built one by one, its plan cost more host time than the rest of the step's host work
(bench/bench_host_overhead.py, "mixed").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch


class PastTable(Sequence):
    """Each segment's past, `table[rows[i], :starts[i]]` (None where starts[i] is 0), made on
    demand as a list of past slots would hold it; `spans` gathers every segment's list at once.

    table: int64 [R, Lmax], contiguous (the pool's request table, on the model's device);
    rows, starts: per segment, its request row and the length of its past.
    """

    def __init__(self, table: torch.Tensor, rows: list[int], starts: list[int]):
        self.table, self.rows, self.starts = table, rows, starts

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # an int, as the per-segment paths read it
        start = self.starts[i]
        return self.table[self.rows[i], :start] if start else None

    def spans(self, counts: numpy.ndarray, keep: numpy.ndarray | None = None) -> torch.Tensor:
        """`table[rows[i], : starts[i] + counts[i]]` of each segment (of those `keep` says,
        bool [S]) one after another: int64 [sum of those lengths], on the table's device.
        counts: int64 [S], each segment's new tokens."""
        rows = numpy.asarray(self.rows, dtype=numpy.int64)
        lengths = numpy.asarray(self.starts, dtype=numpy.int64) + counts
        if keep is not None:
            rows, lengths = rows[keep], lengths[keep]
        total = int(lengths.sum())
        firsts = numpy.cumsum(lengths) - lengths  # where each list starts in the result
        flat = numpy.arange(total, dtype=numpy.int64) + numpy.repeat(
            rows * self.table.shape[1] - firsts, lengths
        )  # [total] index into the flattened table
        where = torch.from_numpy(flat).to(self.table.device, non_blocking=True)
        return self.table.view(-1)[where]
