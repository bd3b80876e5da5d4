"""Which decode steps replay a CUDA graph, and which graph: the bucket keys (pure Python).

A captured graph has fixed shapes, so a step runs the graph of the smallest bucket that holds it,
with padding rows: the batch size B rounds up to the next bucket (1, 2, 4, ... up to the engine's
max batch size, at most MAX_GRAPH_BATCH), the context Lmax (the longest request's positions,
this step's token included) up to the next power of two from `min_len` (capped at the KV
pool's row length), and the largest LoRA rank in the batch up to the next power of two (0: no
request has an adapter, the graph has no LoRA calls). The rank is a key because the Triton
decode launch takes the rank bound as a Python int: BGMV's tile is next_pow2(max_rank), and
MBGMV's workspace is sized by it. Rounding it the same way the eager launch does keeps BGMV's
padding what it is without graphs.

Steps that run eagerly (`StepPlan.reason`): a batch above the largest bucket ("batch"), and a
batch with an adapter still loading ("loading": its layers not yet on the device go to the
host, a host-synchronous call that a graph cannot hold). Prefill never comes here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

MAX_GRAPH_BATCH = 256  # past this, launch overhead is a small part of a step: eager
MIN_GRAPH_LEN = 128  # the smallest context bucket


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class GraphKey(NamedTuple):
    """One captured graph: padded batch size, context length bucket, rank bound (0: no LoRA)."""

    batch: int
    length: int
    rank: int


@dataclass(frozen=True)
class StepPlan:
    """A decode step's graph, or why it runs eagerly (key None)."""

    key: GraphKey | None
    reason: str = ""


@dataclass(frozen=True)
class GraphBuckets:
    """Bucket sizes of one engine. max_batch: the largest batch with a graph; max_len: the KV
    pool's positions per request (the widest `kv_index` a graph may read)."""

    max_batch: int
    max_len: int
    min_len: int = MIN_GRAPH_LEN

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_len < 1 or self.min_len < 1:
            raise ValueError("graph buckets need max_batch, max_len and min_len >= 1")

    @classmethod
    def for_engine(cls, max_batch_size: int, max_len: int) -> GraphBuckets:
        return cls(min(max_batch_size, MAX_GRAPH_BATCH), max_len)

    def batch_sizes(self) -> list[int]:
        """Every batch bucket, ascending: powers of two, then max_batch itself."""
        sizes = [1 << i for i in range(self.max_batch.bit_length()) if 1 << i < self.max_batch]
        return sizes + [self.max_batch]

    def batch_bucket(self, batch_size: int) -> int | None:
        """The padded batch size of a step of batch_size requests; None: above every bucket."""
        if batch_size > self.max_batch:
            return None
        return min(next_pow2(batch_size), self.max_batch)

    def length_bucket(self, context: int) -> int:
        """The kv_index width for a step whose longest request has `context` positions."""
        return min(max(next_pow2(context), self.min_len), self.max_len)

    @staticmethod
    def rank_bucket(max_rank: int) -> int:
        return 0 if max_rank <= 0 else next_pow2(max_rank)

    def plan(self, batch_size: int, context: int, max_rank: int, loading: bool) -> StepPlan:
        """The graph of a decode step. context: the longest request's positions, this step's
        token included; max_rank: the largest adapter rank in the batch (0: none); loading:
        some request's adapter is not wholly on the device yet."""
        if loading:
            return StepPlan(None, "loading")
        batch = self.batch_bucket(batch_size)
        if batch is None:
            return StepPlan(None, "batch")
        key = GraphKey(batch, self.length_bucket(context), self.rank_bucket(max_rank))
        return StepPlan(key)
