"""Which decode steps replay a CUDA graph and which bucket they pad to (pure Python), and the
--cuda-graphs setting."""

from __future__ import annotations

import pytest

from toppings.gpu_lora.adapter_pool import ResidentAdapter
from toppings.server.config import EngineConfig
from toppings.server.model.cuda_graphs import _lora_row
from toppings.server.model.graph_buckets import MAX_GRAPH_BATCH, GraphBuckets, GraphKey, next_pow2


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 17, 64)] == [1, 2, 4, 4, 8, 32, 64]


@pytest.mark.parametrize(
    ("max_batch", "sizes"),
    [(1, [1]), (16, [1, 2, 4, 8, 16]), (48, [1, 2, 4, 8, 16, 32, 48])],
)
def test_batch_buckets_are_powers_of_two_then_the_max(max_batch, sizes):
    buckets = GraphBuckets(max_batch, 512)
    assert buckets.batch_sizes() == sizes
    # Every batch size pads to the smallest bucket that holds it.
    for b in range(1, max_batch + 1):
        assert buckets.batch_bucket(b) == min(s for s in sizes if s >= b)
    assert buckets.batch_bucket(max_batch + 1) is None


def test_odd_batches_pad_up():
    buckets = GraphBuckets(64, 512)
    assert [buckets.batch_bucket(b) for b in (3, 5, 7, 9, 33)] == [4, 8, 8, 16, 64]


def test_length_buckets_start_at_min_len_and_stop_at_the_pool_row():
    buckets = GraphBuckets(8, 300, min_len=128)
    assert [buckets.length_bucket(n) for n in (1, 128, 129, 256, 257, 300)] == [
        128, 128, 256, 256, 300, 300,
    ]  # fmt: skip


def test_rank_bucket_rounds_like_bgmv_tiles():
    assert [GraphBuckets.rank_bucket(r) for r in (0, 1, 8, 12, 16, 33, 64)] == [
        0, 1, 8, 16, 16, 64, 64,
    ]  # fmt: skip


def test_plan_picks_a_graph_or_says_why_not():
    buckets = GraphBuckets(16, 512)
    assert buckets.plan(3, 40, 12, loading=False).key == GraphKey(4, 128, 16)
    assert buckets.plan(5, 200, 0, loading=False).key == GraphKey(8, 256, 0)
    loading = buckets.plan(3, 40, 12, loading=True)
    assert loading.key is None and loading.reason == "loading"
    big = buckets.plan(17, 40, 12, loading=False)
    assert big.key is None and big.reason == "batch"


def test_engine_buckets_stop_at_the_cap():
    assert GraphBuckets.for_engine(16, 512).max_batch == 16
    big = GraphBuckets.for_engine(4 * MAX_GRAPH_BATCH, 512)
    assert big.max_batch == MAX_GRAPH_BATCH
    assert big.plan(MAX_GRAPH_BATCH + 1, 10, 0, loading=False).reason == "batch"


def test_lora_row_gives_rank_only_where_the_adapter_targets():
    adapter = ResidentAdapter("a", offset=40, rank=8, scale=2.0,
                              targets=frozenset({"q_proj", "down_proj"}))  # fmt: skip
    # (offset, then q k v o gate up down)
    assert _lora_row(adapter) == (40, 8, 0, 0, 0, 0, 0, 8)
    assert _lora_row(None) == (0,) * 8


def test_cuda_graphs_default_on_for_cuda_only():
    assert EngineConfig(device="cuda").use_cuda_graphs
    assert not EngineConfig(device="cuda", cuda_graphs=False).use_cuda_graphs
    assert not EngineConfig(device="cpu").use_cuda_graphs
    assert not EngineConfig(device="cpu", cuda_graphs=False).use_cuda_graphs
    with pytest.raises(ValueError, match="--cuda-graphs on needs --device cuda"):
        EngineConfig(device="cpu", cuda_graphs=True)
