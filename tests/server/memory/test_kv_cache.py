"""The KV pool hands out each block once, by slot, and gets every block back."""

from __future__ import annotations

import pytest
import torch

from toppings.server.memory.kv_cache import KVPool


def make_pool(num_slots=32, max_requests=4, max_len=16, block_tokens=1) -> KVPool:
    return KVPool(2, num_slots, 1, 4, max_requests, max_len, torch.float32, "cpu", block_tokens)


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


def test_blocks_cover_positions_and_borrowed_blocks_are_not_freed():
    pool = make_pool(num_slots=64, max_len=40, block_tokens=4)
    a = pool.new_row()
    pool.extend(a, 9)  # 3 blocks, the last one partly used
    assert len(pool.row_blocks[a]) == 3 and pool.num_free_blocks == 16 - 3
    shared = pool.row_blocks[a][:2]
    b = pool.new_row()
    pool.attach_prefix(b, shared)
    assert pool.lengths[b] == 8
    assert pool.req_to_slot[b, :8].tolist() == pool.req_to_slot[a, :8].tolist()
    slots = pool.extend(b, 2)  # a block of its own after the borrowed ones
    assert len(pool.row_blocks[b]) == 3 and not set(slots.tolist()) & set(
        pool.req_to_slot[a, :9].tolist()
    )
    pool.free_row(b)  # gives back only its own block
    assert pool.num_free_blocks == 16 - 3
    pool.free_row(a, keep=shared[:1])  # the first block is now the prefix cache's
    assert pool.num_free_blocks == 16 - 1


def test_a_full_pool_raises_and_reclaims_nothing():
    pool = make_pool(num_slots=8, block_tokens=4)
    held = pool.alloc_blocks(2)
    row = pool.new_row()
    with pytest.raises(RuntimeError, match="KV cache full"):
        pool.extend(row, 3)
    assert pool.num_free_blocks == 0 and len(held) == 2


def test_reserve_gives_a_steps_slots_all_or_none():
    pool = make_pool(num_slots=16, block_tokens=4)
    a, b = pool.new_row(), pool.new_row()
    assert pool.reserve([a, b], [5, 1]) == [0, 0]  # a prompt chunk and a first token
    assert pool.missing_blocks([a, b], [1, 8]) == 0 + 2
    assert pool.reserve([a, b], [1, 3]) == [5, 1]  # a decode and a chunk
    want = [pool.slots_of(pool.row_blocks[r])[: pool.lengths[r]] for r in (a, b)]
    assert pool.lengths[a] == 6 and pool.lengths[b] == 4
    for row, slots in zip((a, b), want):
        assert torch.equal(pool.req_to_slot[row, : pool.lengths[row]], slots)
    free = pool.num_free_blocks  # 4 - 2 - 1: one block left
    with pytest.raises(RuntimeError, match="KV cache full"):
        pool.reserve([a, b], [4, 4])  # two blocks asked: nothing taken
    assert pool.num_free_blocks == free and pool.lengths[a] == 6 and pool.lengths[b] == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native_on", [True, False])
def test_write_stores_strided_keys_and_values_by_slot(dtype, native_on, monkeypatch):
    from toppings.server import native

    if not native_on:
        monkeypatch.setattr(native, "library", lambda: None)
    elif native.library() is None:
        pytest.skip("no C compiler here")
    pool = KVPool(2, 40, 3, 8, 4, 16, dtype, "cpu", 4)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 9 * 8, generator=gen).to(dtype)  # q (3 heads), k, v views as the model
    k, v = qkv[:, 24:48].view(5, 3, 8), qkv[:, 48:].view(5, 3, 8)
    slots = torch.tensor([7, 1, 33, 12, 2])
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k[1][:, slots], k.transpose(0, 1))
    assert torch.equal(pool.v[1][:, slots], v.transpose(0, 1))
    assert not pool.k[0].any() and not pool.v[0].any()  # other layers untouched
    assert int((pool.k[1] != 0).any(dim=-1).sum()) == 15  # only these 5 slots x 3 heads


def test_native_write_refuses_a_slot_outside_the_pool():
    from toppings.server import native

    if native.library() is None:
        pytest.skip("no C compiler here")
    pool = KVPool(1, 8, 1, 4, 2, 8, torch.float32, "cpu", 4)
    k = torch.ones(2, 1, 4)
    with pytest.raises(IndexError):
        pool.write(0, torch.tensor([1, 99]), k, k)
    assert not pool.k.any()  # nothing written
