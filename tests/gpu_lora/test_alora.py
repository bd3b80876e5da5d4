"""Activated LoRA's row cutting (gpu_lora/alora.py): each request's rows before its activation
position become a base-model piece."""

from __future__ import annotations

import pytest

from toppings.gpu_lora.alora import activation_start, split_rows


@pytest.mark.parametrize(
    ("prompt", "start"),
    [([7, 8, 9, 1], 0), ([1, 7, 8, 9], 1), ([7, 8, 9, 5, 7, 8, 9, 2], 4), ([7, 8, 1, 9], None),
     ([8, 9], None), ([1, 2, 7, 8], None)],
)  # fmt: skip
def test_activation_start_is_the_last_occurrence(prompt, start):
    assert activation_start(prompt, [7, 8, 9]) == start


def test_split_rows_cuts_each_request_at_its_start():
    # Four requests of a prefill step: rows [0, 5), [5, 9), [9, 12), [12, 14).
    items = ["a", "b", None, "c"]
    seg_starts = [0, 5, 9, 12, 14]
    positions = [0, 10, 0, 30]  # where each one's rows start in its sequence
    lora_starts = [3, 20, 0, 0]  # a: from position 3; b: after this chunk; c: everywhere
    pieces, starts = split_rows(items, seg_starts, positions, lora_starts)
    assert pieces == [None, "a", None, None, "c"]
    assert starts == [0, 3, 5, 9, 12, 14]


def test_split_rows_leaves_rows_at_or_past_the_start_whole():
    items, seg_starts = ["a", "a"], [0, 4, 6]
    assert split_rows(items, seg_starts, [8, 2], [8, 1]) == (items, seg_starts)
