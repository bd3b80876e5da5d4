"""CUDA graphs of the decode step: one per bucket (server/model/graph_buckets.py), captured lazily.

A decode step of a small model on a GPU is mostly kernel launches (about 15 torch ops a layer
plus two Triton launches per adapted projection). A graph replays them in one launch. Each graph
is `LlamaModel.forward` over fixed buffers of its bucket's shape, which every step fills with one
host-to-device copy: per row its token, position, KV row, LoRA offset, ranks and scale. Inside
the graph the step's slots and `kv_index` are gathered from the pool's `req_to_slot` (which
`KVPool.extend_each` has just written), so no host value of a step is baked into a graph.
Padding rows (index >= B) have valid 0: they write their keys to slot 0, which the pool never
hands out, attend to one position, have rank 0 (no LoRA) and are dropped from the logits.

Capture is lazy, on the first step that needs a bucket, not at start-up: the keys include the
context bucket and the batch's rank bound, which depend on the requests and on adapters
registered at run time (capturing every combination at start-up would take longer than most
runs use), and an adapter pool that grows reallocates its tensors, after which every graph must
be captured again anyway. Not even the base model's buckets (rank 0) are captured at start-up:
a graph keeps its temporaries in the graphs' memory pool, and the largest buckets' (attention
gathers the batch's KV, [K, B, L, D] a layer) would be held from start-up out of the memory the
KV budget was sized on, for steps that may never come; and the first adapter load, which makes
the adapter pool's tensors, drops every graph (below). What a capture would otherwise compile
is compiled before: the Triton kernels it launches are warmed at start-up
(server/model/kernel_warmup.py), so a capture costs only itself. Each capture is logged with its
time; the first step of a new bucket pays it (tens of ms, once). All graphs share one memory
pool: each graph's output is copied into a buffer outside that pool and consumed before the
next replay, so their temporaries may overlap. The graphs hold raw pointers to the KV pool and
the adapter pool's tensors: before every replay the pointers and shapes of those tensors are
compared with the captured ones, and any change (the adapter pool grew, or a new projection
appeared in it) drops every graph.

Written for a GPU but never yet run on one (no GPU has been lent to this project): see
tests/server/model/test_cuda_graphs.py, marked `cuda`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy
import torch

from toppings.gpu_lora.adapter_pool import AdapterPool, ResidentAdapter
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.server.memory.kv_cache import KVPool
from toppings.server.model.graph_buckets import GraphBuckets, GraphKey
from toppings.server.model.llama import ForwardBatch, LlamaModel

log = logging.getLogger(__name__)

# Rows of the int64 step buffer [F, max_batch]; then one row of ranks per LORA_TARGETS module.
IDS, POSITIONS, KV_ROWS, VALID, OFFSETS, RANKS = range(6)


@functools.lru_cache(maxsize=4096)
def _lora_row(adapter: ResidentAdapter | None) -> tuple[int, ...]:
    """(offset, rank of each LORA_TARGETS module) of one row; zeros for the base model."""
    if adapter is None:
        return (0,) * (1 + len(LORA_TARGETS))
    ranks = (adapter.rank if m in adapter.targets else 0 for m in LORA_TARGETS)
    return (adapter.offset, *ranks)


class StaticLora:
    """`LoraBatch.add` over a graph's fixed row buffers: every projection of the pool, with rank
    0 where a row's adapter does not target it (the kernels skip those rows)."""

    def __init__(self, pool: AdapterPool, decode, offsets, ranks: dict, scales, max_rank: int):
        """decode: the engine's Triton decode kernel; offsets [B] int32; ranks: module -> [B]
        int32; scales [B] float32; max_rank: the bucket's rank bound (a Python int)."""
        self.pool, self._decode, self._max_rank = pool, decode, max_rank
        self._offsets, self._ranks, self._scales = offsets, ranks, scales
        self.version = None  # a graph's LoRA runs no native decode path (`native_runs`)

    def add(self, layer: int, x: torch.Tensor, outputs) -> None:
        """y += LoRA delta for each (module, y); x [B, H_in], y [B, H_out], in place."""
        for module, y in outputs:
            ranks = self._ranks.get(module)
            if ranks is not None:
                a, b = self.pool.lora_a[module][layer], self.pool.lora_b[module][layer]
                self._decode(y, x, a, b, self._offsets, ranks, self._scales, self._max_rank)

    def native_runs(self) -> None:
        """None: a graph's LoRA is its kernel's, called by `add` (server.model.llama.StepLora)."""
        return None


@dataclass
class GraphCounters:
    """What the decode graphs did since start (read by tests and bench_cuda_graphs): steps
    replayed, graphs captured, times every graph was dropped because a tensor it points into
    moved, and steps run eagerly by the reason the bucket plan gave ("loading", ...)."""

    replays: int = 0
    captures: int = 0
    invalidations: int = 0
    eager: Counter[str] = field(default_factory=Counter)

    def copy(self) -> GraphCounters:
        return replace(self, eager=Counter(self.eager))

    def to_json(self) -> dict[str, int]:
        """One flat object: the three counts and `eager_<reason>` per reason."""
        counts = {"replays": self.replays, "captures": self.captures}
        counts["invalidations"] = self.invalidations
        return counts | {"eager_" + reason: n for reason, n in self.eager.items()}


class DecodeGraphs:
    """The captured decode graphs of one engine and the buffers they read and write."""

    def __init__(
        self, model: LlamaModel, kv: KVPool, pool: AdapterPool, decode, buckets: GraphBuckets
    ):
        """decode: the engine's LoRA decode kernel (`LoraBackend.decode`, Triton on CUDA)."""
        self.model, self.kv, self.pool, self.buckets = model, kv, pool, buckets
        self._decode = decode
        device, width = model.device, buckets.max_batch
        on_gpu = device.type == "cuda"  # else a CPU test of the buffers, without capture
        self._host = torch.zeros(RANKS + len(LORA_TARGETS), width, dtype=torch.int64)
        self._host_scales = torch.zeros(width, dtype=torch.float32)
        if on_gpu:
            self._host, self._host_scales = self._host.pin_memory(), self._host_scales.pin_memory()
        self._array, self._array_scales = self._host.numpy(), self._host_scales.numpy()
        self._lora_of: list | None = None  # the adapters whose LoRA rows the buffers hold
        self._meta = torch.zeros(self._host.shape, dtype=torch.int64, device=device)
        self._scales = torch.zeros(width, dtype=torch.float32, device=device)
        self._rows = torch.arange(width, device=device)
        vocab = model.lm_head.out_features
        self._logits = torch.zeros(width, vocab, dtype=torch.float32, device=device)  # [Bmax, V]
        self._copied = torch.cuda.Event() if on_gpu else None  # the last step's copy
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._mempool = None
        self._pointers = self._pointer_state()
        self._disabled = False  # a capture failed: every step runs eagerly from then on
        self.counters = GraphCounters()
        self.capture_s = 0.0

    def run(
        self,
        ids: numpy.ndarray,
        positions: numpy.ndarray,
        kv_rows: numpy.ndarray,
        adapters: list[ResidentAdapter | None],
        loading: bool,
    ) -> torch.Tensor | None:
        """Logits [B, V] float32 of a decode step by graph replay; None: run it eagerly.

        ids, positions, kv_rows [B] int64: per request its last token, that token's position
        (its slot is already in `req_to_slot`) and its KV row; adapters: where each request's
        adapter sits in the pool (None: base model); loading: some adapter of the batch is not
        wholly resident.
        """
        b = len(ids)
        max_rank = max((a.rank for a in adapters if a is not None), default=0)
        length = int(positions.max()) + 1 if b else 1
        plan = self.buckets.plan(b, length, max_rank, loading)
        if plan.key is None or self._disabled:
            self.counters.eager[plan.reason or "disabled"] += 1
            return None
        self._check_pointers()
        graph = self._graphs.get(plan.key)
        if graph is None and (graph := self._capture(plan.key)) is None:
            return None
        self._fill(ids, positions, kv_rows, adapters)
        graph.replay()
        self.counters.replays += 1
        return self._logits[:b].clone()

    def drop(self) -> None:
        """Forget every graph and their memory pool (they are captured again when needed)."""
        self._graphs.clear()
        self._mempool = None

    @property
    def keys(self) -> frozenset[GraphKey]:
        """The buckets with a captured graph now."""
        return frozenset(self._graphs)

    def _pointer_state(self) -> tuple:
        """Every tensor a graph holds a pointer to, by address and shape."""
        modules = tuple(sorted(self.pool.lora_a))
        tensors = [self.kv.k, self.kv.v, self.kv.req_to_slot]
        tensors += [t[m] for m in modules for t in (self.pool.lora_a, self.pool.lora_b)]
        return modules, tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)

    def _check_pointers(self) -> None:
        state = self._pointer_state()
        if state == self._pointers:
            return
        if self._graphs:
            log.info("the adapter pool or KV pool was reallocated: dropping %d decode graphs",
                     len(self._graphs))  # fmt: skip
            self.counters.invalidations += 1
        self.drop()
        self._pointers = state

    def _fill(self, ids, positions, kv_rows, adapters: list) -> None:
        """The step's rows into the fixed buffers, padding rows zero; one copy each. The rows'
        LoRA fields (valid, offset, ranks, scale) are written only when the adapters differ from
        the last step's (a decode batch keeps its requests for many steps); the other three
        fields every step, as numpy slices."""
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the pinned buffers (long since)
        b, host = len(ids), self._array
        if adapters != self._lora_of:  # the same objects in the same order: the same rows
            host[...] = 0
            self._array_scales[...] = 0.0
            if b:
                host[VALID, :b] = 1
                host[OFFSETS:, :b] = numpy.array([_lora_row(a) for a in adapters]).T
                self._array_scales[:b] = [a.scale if a else 0.0 for a in adapters]
            self._lora_of = list(adapters)
        host[IDS, :b], host[POSITIONS, :b], host[KV_ROWS, :b] = ids, positions, kv_rows
        self._meta.copy_(self._host, non_blocking=True)
        self._scales.copy_(self._host_scales, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _capture(self, key: GraphKey) -> torch.cuda.CUDAGraph | None:
        started = time.perf_counter()
        empty = numpy.zeros(0, dtype=numpy.int64)
        self._lora_of = None
        self._fill(empty, empty, empty, [])  # every row padding while warming up and capturing
        try:
            graph = self._record(key)
        except Exception:  # an op that cannot be captured: keep serving, eagerly
            log.exception("capturing the decode graph %s failed; decode runs eagerly", key)
            self._disabled = True
            self.drop()
            return None
        seconds = time.perf_counter() - started
        self.capture_s += seconds
        self.counters.captures += 1
        log.info("decode graph %s captured in %.0f ms (%d graphs now, %.2f s of captures so far)",
                 tuple(key), 1000 * seconds, len(self._graphs), self.capture_s)  # fmt: skip
        return graph

    def _record(self, key: GraphKey) -> torch.cuda.CUDAGraph:
        device = self.model.device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(key)  # warm-up: sets up cuBLAS (the Triton kernels were compiled)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the adapter loader's thread keeps copying on its own stream meanwhile.
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            self._forward(key)
        if self._mempool is None:
            self._mempool = graph.pool()
        self._graphs[key] = graph
        return graph

    @torch.inference_mode()
    def _forward(self, key: GraphKey) -> None:
        """The forward pass of a bucket over the fixed buffers; logits into self._logits."""
        b, length, rank = key
        meta = self._meta[:, :b]
        kv_rows, positions = meta[KV_ROWS], meta[POSITIONS]  # [B] int64
        req_to_slot = self.kv.req_to_slot
        slots = req_to_slot[kv_rows, positions] * meta[VALID]  # [B]; padding rows: slot 0
        lora = None
        if rank:
            # int32, as a step's LoraBatch passes them: the same kernel variants as eager decode
            # (one cast in the graph, not a second set of variants compiled for int64 indices).
            rows = meta[OFFSETS:].to(torch.int32)  # [1 + len(LORA_TARGETS), B]
            ranks = {m: rows[RANKS - OFFSETS + i] for i, m in enumerate(LORA_TARGETS)
                     if m in self.pool.lora_a}  # fmt: skip
            lora = StaticLora(self.pool, self._decode, rows[0], ranks, self._scales[:b], rank)
        batch = ForwardBatch(
            input_ids=meta[IDS],
            positions=positions,
            slots=slots,
            seg_starts=list(range(b + 1)),
            is_prefill=False,
            kv_index=req_to_slot[:, :length].index_select(0, kv_rows),  # [B, Lb]
            kv_lengths=positions + 1,  # padding rows: position 0, one position
            lora=lora,
            logit_rows=self._rows[:b],
        )
        self._logits[:b].copy_(self.model.forward(batch, self.kv)[0])  # [B, V]
