"""The token-level KV pool hands out each slot once and gets every slot back."""

from __future__ import annotations

import pytest
import torch

from toppings.server.kv_cache import KVPool


def make_pool(num_slots=32, max_requests=4, max_len=16) -> KVPool:
    return KVPool(2, num_slots, 1, 4, max_requests, max_len, torch.float32)


def test_slots_are_unique_and_never_zero():
    pool = make_pool()
    rows = [pool.new_row() for _ in range(3)]
    got = torch.cat([pool.extend(r, n) for r, n in zip(rows, (5, 7, 3))])
    got = torch.cat([got, pool.extend_each(rows)])
    assert got.unique().numel() == got.numel() == 18
    assert int(got.min()) >= 1
    assert pool.num_free_slots == 32 - 18
    assert [pool.lengths[r] for r in rows] == [6, 8, 4]


def test_free_row_returns_every_slot_and_row():
    pool = make_pool()
    for _ in range(5):  # reuse rows and slots many times: nothing may leak
        rows = [pool.new_row() for _ in range(4)]
        for r in rows:
            pool.extend(r, 6)
        pool.extend_each(rows)
        for r in rows:
            pool.free_row(r)
    assert pool.num_free_slots == 32
    assert pool.num_free_rows == 4


def test_full_pool_and_long_request_raise():
    pool = make_pool(num_slots=8)
    row = pool.new_row()
    pool.extend(row, 8)
    with pytest.raises(RuntimeError, match="KV cache full"):
        pool.extend_each([row])
    pool.free_row(row)
    row = pool.new_row()
    with pytest.raises(RuntimeError, match="exceed"):
        pool.extend(row, 17)


def test_decode_index_gives_lengths_and_the_written_slots():
    pool = make_pool()
    a, b = pool.new_row(), pool.new_row()
    sa, sb = pool.extend(a, 3), pool.extend(b, 1)
    k = torch.arange(4, dtype=torch.float32).reshape(4, 1, 1).expand(4, 1, 4).contiguous()
    pool.write(0, torch.cat([sa, sb]), k, k + 10)
    index, lengths = pool.decode_index([a, b])
    assert lengths.tolist() == [3, 1] and index.shape == (2, 3)
    assert pool.k[0][0][index][0, :, 0].tolist() == [0.0, 1.0, 2.0]
    assert pool.v[0][0][index][1, 0, 0].item() == 13.0
