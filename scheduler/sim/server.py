"""One simulated server: continuous batching on the perf models (see scheduler/sim/simulator.py).

When requests wait and fit (batch size, KV slots for prompt + output, prefill token budget), the
next iteration prefills them, FIFO, and they emit their first token; otherwise it decodes one
token for the whole running batch. A request whose adapter is still being fetched into host
memory (scheduler/sim/adapter_pool.py) is counted as queued from the moment it is routed, but joins
the FIFO only when the adapter has arrived (`enqueue(..., fetching=True)`, then `release`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.sim.adapter_pool import AdapterStoreConfig
from toppings.scheduler.sim.prefix_cache import SimPrefixCaches
from toppings.scheduler.sim.trace import TraceRequest
from toppings.scheduler.state import BatchShape, ServerState


@dataclass(frozen=True)
class SimConfig:
    """Per-server limits mirror server.config.EngineConfig's defaults, except the KV slots:
    40,000 tokens is ~20 GB of Llama-7B fp16 KV (0.5 MB per token), what an A100-40GB has left
    after the weights and activations."""

    num_servers: int = 60
    kernel: str = "bgmv"
    max_total_tokens: int = 40_000
    max_batch_size: int = 128
    max_prefill_tokens: int = 8192
    warmup_fraction: float = 0.1  # arrivals in the first 10% of the trace are not measured
    # Like the scheduler's /stats polling: policies see snapshots taken every refresh_s (at the
    # first arrival after each tick) plus the requests routed since; 0 means always fresh.
    refresh_s: float = 0.1
    # Bounded host memory per server and a cost per adapter miss (scheduler/sim/adapter_pool.py);
    # None: every adapter is in every server's host memory and a miss never happens.
    adapter_store: AdapterStoreConfig | None = None

    def __post_init__(self) -> None:
        if self.num_servers < 1 or self.kernel not in ("bgmv", "mbgmv"):
            raise ValueError("num_servers must be >= 1 and kernel bgmv or mbgmv")
        if self.refresh_s < 0:
            raise ValueError("refresh_s must be >= 0")


@dataclass(slots=True)
class SimRequest:
    trace: TraceRequest
    first_token_s: float = math.nan
    finish_s: float = math.nan
    fetch_wait_s: float = 0.0  # waited for its adapter to reach host memory
    cached_tokens: int = 0  # of its prompt, found in its server's prefix cache


class _RankSet:
    """Aggregates of a request set that supports removal (max rank from per-rank counts)."""

    __slots__ = ("counts", "num", "sum_rank", "sum_tokens", "sum_token_rank")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.num = self.sum_rank = self.sum_tokens = self.sum_token_rank = 0

    def change(self, rank: int, tokens: int, sign: int) -> None:
        self.counts[rank] = self.counts.get(rank, 0) + sign
        self.num += sign
        self.sum_rank += sign * rank
        self.sum_tokens += sign * tokens
        self.sum_token_rank += sign * tokens * rank

    def shape(self) -> BatchShape:
        max_rank = max((r for r, c in self.counts.items() if c), default=0)
        return BatchShape(self.num, self.sum_rank, max_rank, self.sum_tokens, self.sum_token_rank)


class SimServer:
    """One server's queue, running batch and iteration clock."""

    def __init__(
        self,
        idx: int,
        config: SimConfig,
        perf: PerfModels,
        adapters: frozenset[str],
        prefix: SimPrefixCaches | None = None,
    ):
        """prefix: the servers' cached conversation prefixes (None: no prefix cache)."""
        self.idx = idx
        self.prefix = prefix
        self.config = config
        self.decode_model = perf.decode(config.kernel)
        self.prefill_model = perf.prefill(config.kernel)
        self.adapters = adapters
        self.waiting: deque[SimRequest] = deque()
        self.running: list[tuple[int, int, SimRequest]] = []  # heap of (finish step, idx, request)
        self.wait_set, self.run_set = _RankSet(), _RankSet()
        self.reserved_tokens = 0  # KV slots of admitted requests (prompt + output each)
        self.queued_tokens = 0  # the same, of waiting requests
        self.step = 0
        self.busy = False
        self.prefilling: list[SimRequest] = []
        self._state: ServerState | None = None

    def state(self) -> ServerState:
        if self._state is None:
            queue = self.wait_set.shape()
            cfg_total = self.config.max_total_tokens
            self._state = ServerState(
                url=f"sim-{self.idx}",
                kernel=self.config.kernel,
                healthy=True,
                num_running=self.run_set.num + len(self.prefilling),
                num_queued=self.wait_set.num,
                batch=self.run_set.shape().merge(queue),
                queue=queue,
                room_tokens=cfg_total - self.reserved_tokens - self.queued_tokens,
                adapters=self.adapters,
            )
        return self._state

    def enqueue(self, request: SimRequest, fetching: bool = False) -> None:
        """Queue `request`; one still `fetching` its adapter counts as queued but waits for
        `release` to join the FIFO."""
        if not fetching:
            self.waiting.append(request)
        self.wait_set.change(request.trace.rank, request.trace.prompt_tokens, +1)
        self.queued_tokens += request.trace.prompt_tokens + request.trace.output_tokens
        self._state = None

    def release(self, request: SimRequest) -> None:
        """The adapter of a request queued with `fetching=True` has arrived."""
        self.waiting.append(request)

    def start_iteration(self, now: float) -> float | None:
        """Begin the next iteration; returns its end time, or None when there is nothing to do."""
        cfg = self.config
        admitted: list[SimRequest] = []
        num_tokens = 0
        while self.waiting:
            trace = self.waiting[0].trace
            need = trace.prompt_tokens + trace.output_tokens
            if (
                len(self.running) + len(admitted) >= cfg.max_batch_size
                or self.reserved_tokens + need > cfg.max_total_tokens
                or (admitted and num_tokens + trace.prompt_tokens > cfg.max_prefill_tokens)
            ):
                break
            admitted.append(self.waiting.popleft())
            self.wait_set.change(trace.rank, trace.prompt_tokens, -1)
            self.reserved_tokens += need
            self.queued_tokens -= need
            num_tokens += trace.prompt_tokens
        if admitted:
            if self.prefix is not None:
                url = self.state().url
                for r in admitted:
                    r.cached_tokens = self.prefix.cached(url, r.trace)
            shape = BatchShape.of(
                (r.trace.rank for r in admitted),
                (r.trace.prompt_tokens - r.cached_tokens for r in admitted),
            )
            self.prefilling = admitted
            duration_ms = self.prefill_model.predict(shape)
        elif self.running:
            duration_ms = self.decode_model.predict(self.run_set.shape())
        else:
            self.busy = False
            return None
        self.busy = True
        self._state = None
        return now + duration_ms / 1000.0

    def finish_iteration(self, now: float, done: list[SimRequest]) -> None:
        """End the current iteration at `now`; appends finished requests to `done`."""
        if self.prefilling:
            for request in self.prefilling:
                request.first_token_s = now
                trace = request.trace
                if self.prefix is not None:
                    self.prefix.store(self.state().url, trace)
                if trace.output_tokens <= 1:
                    self._finish(request, now, done)
                    continue
                self.run_set.change(trace.rank, trace.prompt_tokens, +1)
                finish_step = self.step + trace.output_tokens - 1
                heapq.heappush(self.running, (finish_step, trace.idx, request))
            self.prefilling = []
        else:
            self.step += 1
            while self.running and self.running[0][0] <= self.step:
                request = heapq.heappop(self.running)[2]
                self.run_set.change(request.trace.rank, request.trace.prompt_tokens, -1)
                self._finish(request, now, done)
        self._state = None

    def _finish(self, request: SimRequest, now: float, done: list[SimRequest]) -> None:
        request.finish_s = now
        self.reserved_tokens -= request.trace.prompt_tokens + request.trace.output_tokens
        done.append(request)
